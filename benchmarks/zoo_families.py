"""The zoo's family sweep: more timm, smp and transformers architectures, values only.

Each model is built from its package as it ships (random init, eval mode, float32) and run
once on a padless batch; every sample's output is compared with the model on that sample
alone. No timing: this table says which families run unchanged and give each sample its
own answer; the speed rows are in ``benchmarks/zoo.py``'s main table.

    PYTHONPATH=. zoo/.venv/bin/python benchmarks/zoo_families.py [--only timm,smp,transformers]
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import traceback
import warnings
from typing import Callable

import torch

import padless

TIMM = ["resnet18", "efficientnet_b0", "mobilenetv3_small_100", "convnext_atto", "regnetx_002", "densenet121",
        "resnext26ts", "ghostnet_100", "rexnet_100", "cspresnet50", "seresnet18", "mixnet_s", "dla34", "hrnet_w18_small"]
SMP = ["Unet", "UnetPlusPlus", "FPN", "Linknet", "PSPNet", "DeepLabV3", "DeepLabV3Plus", "PAN", "UPerNet", "MAnet", "Segformer"]
HF = ["bert", "llama", "gpt2", "opt", "gpt_neox", "qwen2", "mistral", "gemma", "phi3", "roberta", "distilbert", "electra"]


@dataclasses.dataclass
class Row:
    family: str
    name: str
    status: str  # "yes", or the error
    diff: str = "—"


def _where(e: BaseException) -> str:
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "site-packages/" in f.filename and "/torch/" not in f.filename]
    return f" [{frames[-1].filename.split('site-packages/')[-1]}:{frames[-1].lineno}]" if frames else ""


def _first_line(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"


def _compare(build: Callable[[], torch.nn.Module], samples: list[torch.Tensor], run_batch, run_one) -> tuple[str, str]:
    torch.manual_seed(0)
    model = build().eval()
    with torch.no_grad():
        try:
            outs = run_batch(model, samples)
        except Exception as e:  # noqa: BLE001
            try:  # does the model accept every sample alone? then padless is at fault
                for s in samples:
                    run_one(model, s)
            except Exception:  # noqa: BLE001
                return f"no: the model rejects a sample alone too ({_first_line(e)[:80]})", "—"
            return f"no: {_first_line(e)}{_where(e)}", "—"
        diff = peak = 0.0
        for got, s in zip(outs, samples):
            ref = run_one(model, s)
            diff = max(diff, (got - ref).abs().max().item())
            peak = max(peak, ref.abs().max().item())
    if diff > 1e-4 * max(1.0, peak):
        return "**no: wrong values** (a sample differs from the model on it alone)", f"{diff:.1e} / {peak:.1e}"
    return "yes", f"{diff:.1e} / {peak:.1e}"


def _images(sizes: list[tuple[int, int]]) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randn(3, h, w, generator=g) for h, w in sizes]


def _img_batch(model, xs):
    out = model(padless.from_list(xs))
    return out.unbind() if isinstance(out, padless.NestedTensor) else list(out)


def _img_one(model, x):
    return model(x[None])[0]


def timm_rows() -> list[Row]:
    import timm

    xs = _images([(64, 96), (96, 64), (128, 128)])
    return [Row("timm", n, *_compare(lambda n=n: timm.create_model(n, pretrained=False, num_classes=10), xs, _img_batch, _img_one))
            for n in TIMM]


def smp_rows() -> list[Row]:
    import segmentation_models_pytorch as smp

    xs = _images([(128, 160), (160, 128), (192, 192)])
    return [Row("smp", f"{a} (resnet18)", *_compare(lambda a=a: getattr(smp, a)(encoder_name="resnet18", encoder_weights=None, classes=2),
                                                     xs, _img_batch, _img_one)) for a in SMP]


def _hf_model(kind: str) -> torch.nn.Module:
    import transformers as t

    H = 32
    c = dict(vocab_size=100, hidden_size=H, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128)
    nd = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    make = {
        "bert": lambda: t.BertModel(t.BertConfig(**c, **nd)),
        "llama": lambda: t.LlamaModel(t.LlamaConfig(**c, num_key_value_heads=2)),
        "gpt2": lambda: t.GPT2Model(t.GPT2Config(vocab_size=100, n_embd=H, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)),
        "opt": lambda: t.OPTModel(t.OPTConfig(vocab_size=100, hidden_size=H, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4,
                                             max_position_embeddings=128, word_embed_proj_dim=H, dropout=0.0, attention_dropout=0.0)),
        "gpt_neox": lambda: t.GPTNeoXModel(t.GPTNeoXConfig(**c, hidden_dropout=0.0, attention_dropout=0.0)),
        "qwen2": lambda: t.Qwen2Model(t.Qwen2Config(**c, num_key_value_heads=2)),
        "mistral": lambda: t.MistralModel(t.MistralConfig(**c, num_key_value_heads=2)),
        "gemma": lambda: t.GemmaModel(t.GemmaConfig(**c, num_key_value_heads=2, head_dim=8)),
        "phi3": lambda: t.Phi3Model(t.Phi3Config(**c, num_key_value_heads=2, pad_token_id=0)),
        "roberta": lambda: t.RobertaModel(t.RobertaConfig(**c, **nd)),
        "distilbert": lambda: t.DistilBertModel(t.DistilBertConfig(vocab_size=100, dim=H, n_layers=2, n_heads=4, hidden_dim=64, dropout=0.0, attention_dropout=0.0)),
        "electra": lambda: t.ElectraModel(t.ElectraConfig(**c, embedding_size=H, **nd)),
    }
    return make[kind]()


def hf_rows() -> list[Row]:
    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(n, 32, generator=g) for n in (5, 17, 1, 40)]
    batch = lambda m, s: m(inputs_embeds=padless.from_list(s)).last_hidden_state.unbind()  # noqa: E731
    one = lambda m, s: m(inputs_embeds=s[None]).last_hidden_state[0]  # noqa: E731
    return [Row("transformers", f"{k} (inputs_embeds=nt, sdpa)", *_compare(lambda k=k: _hf_model(k), xs, batch, one)) for k in HF]


def rows(only: str = "") -> list[Row]:
    warnings.filterwarnings("ignore")
    out = []
    for fam, fn in (("timm", timm_rows), ("smp", smp_rows), ("transformers", hf_rows)):
        if only and fam not in only:
            continue
        try:
            out += fn()
        except ImportError as e:
            out.append(Row(fam, "(package missing)", f"skipped: {e}"))
    return out


def table(rs: list[Row]) -> str:
    lines = ["| family | model | runs unchanged, each sample its own answer | max diff / max abs output (eval, fp32) |",
             "|---|---|---|---:|"]
    lines += [f"| {r.family} | {r.name} | {r.status} | {r.diff} |" for r in rs]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", default="", help="comma list of timm, smp, transformers")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    print(table(rows(args.only)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
