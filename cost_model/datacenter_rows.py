"""The published datacenter training runs (../shared/reference/gpu-tables/transformer_training_datacenter.csv)
as rows the cost model can price: each row's architecture, layout, precision and published step time.

Terms:
  row         -- one published run: a dense transformer (hidden, heads, kv_heads, ffn_hidden, gated or plain
                 MLP, seq_len, vocab) trained on ``gpus`` GPUs as tp x pp x cp x dp, in a precision, with
                 a data-parallel flavour and activation checkpointing.
  layout      -- what autosplit plans for the row: mesh (pp, tp, dp); the microbatch (``micro_batch``
                 sequences) and ``microbatches`` per step per replica (global_batch / (dp * micro_batch));
                 ``chunks`` per pipeline rank (the row's vpp; schedule "interleaved" when > 1, else
                 "1f1b"); ``dp_shard`` "layer" for FSDP (FSDP2 units per transformer block), False for
                 DDP and Megatron's distributed optimizer (ZeRO-1: a reduce-scatter and an all-gather of the
                 gradients / parameters, an all-reduce's volume); ``recompute`` "block" for full
                 checkpointing, None otherwise (selective per-op checkpointing recomputes the cheap
                 pointwise ops only); ``autocast`` bf16 / fp16.
  approx      -- what the layout only approximates, said per row (HSDP priced as full shard, SHARD_GRAD_OP
                 as full shard, a checkpointed fraction of blocks not stated, a micro batch not stated).
  unpriceable -- a row the model cannot price, with the reason: a GPU without a built-in profile (B200,
                 GB200), FP8 compute (the profile has no FP8 rate: attention and non-linear ops stay bf16
                 while the linears run at twice the rate, a mix the planner does not express), context
                 parallelism (cp > 1), TF32 (the profiles' float32 rate is the CUDA-core one; TF32 tensor
                 cores are not a dtype autosplit plans for).
  published   -- seconds of one optimizer step per GPU: tokens per step per GPU / published tokens per
                 second per GPU.  Where the source gives only model TFLOP/s, tokens/s = TFLOP/s / FLOPs per
                 token of the source's own convention (``flops_convention``: MEG_FULL, MEG21_RECOMP);
                 BERT: sequences per second over all GPUs.
  model FLOPs -- per token 6 * (weights of every matmul, the vocab head included) + 12 * layers * hidden *
                 seq_len (full attention scores, the usual MFU convention); MFU = model FLOPs per second
                 per GPU / the datasheet bf16 / fp16 peak (A100 312, H100 989 TFLOP/s).

Pure: reads the CSV, no torch models, no pricing.
"""
from __future__ import annotations

import csv
import dataclasses
from pathlib import Path

TABLE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "gpu-tables" / \
    "transformer_training_datacenter.csv"
PEAK = {"a100": 312e12, "h100": 989e12, "h200": 989e12}      # dense bf16 / fp16 tensor peaks (MFU)
_BERT_PREDICTIONS = {128: 20, 512: 80}    # masked positions per sequence (NVIDIA's BERT phase 1 / 2 configs)


@dataclasses.dataclass(frozen=True)
class Row:
    """One published run (see Terms)."""
    id: str
    model: str
    gpu: str                  # built-in profile name ("h100", "a100", "h200") or the source's GPU text
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    ffn_hidden: int
    gated: bool               # SwiGLU (three ffn matrices); else a two-matrix GELU MLP
    causal: bool              # a decoder (LLM); False: BERT's bidirectional encoder
    seq_len: int
    vocab: int
    head_tokens: int          # tokens per sequence the vocab head runs on (BERT: the masked positions only)
    gpus: int
    tp: int
    pp: int
    dp: int
    chunks: int
    micro_batch: int
    microbatches: int
    dp_shard: object          # "layer" or False
    recompute: str | None     # "block" or None
    autocast: str | None      # "bfloat16" / "float16"
    published_s: float        # seconds per step (see *published*)
    approx: str               # what the layout approximates ("" when nothing)
    unpriceable: str          # why the model cannot price the row ("" when it can)

    @property
    def model_flops_per_token(self) -> float:
        """6 * matmul weights + 12 * layers * hidden * seq_len (see *model FLOPs*)."""
        d = self.hidden // self.heads
        attn = self.hidden * (2 * self.hidden + 2 * self.kv_heads * d)
        mlp = (3 if self.gated else 2) * self.hidden * self.ffn_hidden
        head = self.hidden * self.vocab * self.head_tokens / self.seq_len
        return 6 * (self.layers * (attn + mlp) + head) + 12 * self.layers * self.hidden * self.seq_len

    @property
    def tokens_per_gpu(self) -> float:
        """Tokens one GPU's step covers: the global batch's tokens over the GPUs."""
        return self.dp * self.micro_batch * self.microbatches * self.seq_len / self.gpus

    def mfu(self, seconds: float) -> float:
        """Model FLOPs utilisation of a step of ``seconds`` (see *model FLOPs*)."""
        return self.model_flops_per_token * self.tokens_per_gpu / seconds / PEAK[self.gpu]


def _int(text: str, default: int = 0) -> int:
    text = (text or "").strip()
    return int(float(text)) if text else default


def _gpu(text: str) -> str:
    low = text.lower()
    for key in ("h200", "h100", "a100"):
        if key in low:
            return key
    return text


def _source_flops_per_token(r: dict) -> float:
    """FLOPs per token of the row's own convention (README "FLOPs per token"), for rows that publish TFLOP/s only."""
    L, h, s, V = _int(r["layers"]), _int(r["hidden"]), _int(r["seq_len"]), _int(r["vocab"])
    a, g, f = _int(r["heads"]), _int(r["kv_heads"]), _int(r["ffn_hidden"])
    gated = r["mlp"].startswith("SwiGLU")
    if r["flops_convention"] == "MEG_FULL":
        d = h // a
        return 12 * L * h * h * ((1 + g / a + s / h) * (a * d / h) + (f / h) * (1.5 if gated else 1.0)) + 6 * h * V
    if r["flops_convention"] == "MEG21_RECOMP":
        return 96 * L * h * h * (1 + s / (6 * h)) + 6 * h * V
    raise ValueError(f"row {r['id']}: no tokens/s and convention {r['flops_convention']!r} not handled")


def _tokens_per_s_per_gpu(r: dict) -> float:
    if r["tokens_per_s_per_gpu"].strip():
        return float(r["tokens_per_s_per_gpu"])
    if r["id"].startswith("bert"):
        sequences = float(r["other_metric"].split()[0])
        return sequences * _int(r["seq_len"]) / _int(r["gpus"])
    if r["tflops_per_gpu"].strip():
        return float(r["tflops_per_gpu"]) * 1e12 / _source_flops_per_token(r)
    raise ValueError(f"row {r['id']}: no published throughput")


def _unpriceable(r: dict, gpu: str) -> str:
    precision = r["precision"].lower()
    if gpu not in PEAK:
        return f"GPU {r['gpu']!r} has no built-in profile"
    if "fp8" in precision or "mxfp8" in precision:
        return f"FP8 ({r['precision']}): no FP8 rate in the profiles"
    if _int(r["cp"], 1) > 1:
        return f"context parallel cp={r['cp']}"
    if precision.startswith("tf32"):
        return "TF32: the profiles' float32 rate is the CUDA-core one"
    return ""


def _layout(r: dict) -> tuple[object, str | None, list[str]]:
    """(dp_shard, recompute, approximations) of a row."""
    flavour, ckpt = r["fsdp_zero"].lower(), r["activation_checkpointing"].lower()
    approx = []
    if "fsdp" in flavour or "hsdp" in flavour or "shard" in flavour:
        shard = "layer"
        if "hsdp" in flavour or "hybrid" in flavour:
            approx.append("HSDP priced as full shard")
        if "shard_grad_op" in flavour:
            approx.append("SHARD_GRAD_OP priced as full shard")
    else:
        shard = False                    # DDP, Megatron's distributed optimizer, one GPU
    recompute = "block" if ckpt.startswith("full") else None
    if ckpt.startswith("selective") and "fraction" in ckpt:
        approx.append("checkpointed fraction of blocks not stated: priced without")
    if ckpt.startswith("not stated"):
        approx.append("checkpointing not stated: priced without")
    return shard, recompute, approx


def load_rows(path: Path | str = TABLE) -> list[Row]:
    """Every row of the table as a Row (unpriceable rows too, with the reason)."""
    out = []
    with open(path, newline="") as f:
        for r in csv.DictReader(f):
            gpu = _gpu(r["gpu"])
            tp, pp, dp, gpus = _int(r["tp"], 1), _int(r["pp"], 1), _int(r["dp"], 1), _int(r["gpus"])
            global_batch = _int(r["global_batch"])
            approx = []
            micro = _int(r["micro_batch"])
            if not micro:
                micro = 1
                approx.append("micro batch not stated: 1 assumed")
            per_replica = global_batch // max(dp, 1)
            microbatches = max(1, per_replica // micro)
            shard, recompute, more = _layout(r)
            approx += more
            precision = r["precision"].lower()
            autocast = "float16" if precision.startswith("fp16") else "bfloat16"
            seq = _int(r["seq_len"])
            bert = r["id"].startswith("bert")
            head_tokens = _BERT_PREDICTIONS.get(seq, seq) if bert else seq
            if bert:
                approx.append(f"MLM head on {head_tokens} masked positions per sequence (ASSUMED)")
            tokens_step_gpu = global_batch * seq / gpus
            out.append(Row(
                id=r["id"], model=r["model"], gpu=gpu, layers=_int(r["layers"]), hidden=_int(r["hidden"]),
                heads=_int(r["heads"]), kv_heads=_int(r["kv_heads"]), ffn_hidden=_int(r["ffn_hidden"]),
                gated=r["mlp"].startswith("SwiGLU"), causal=not bert, seq_len=seq, vocab=_int(r["vocab"]),
                head_tokens=head_tokens, gpus=gpus, tp=tp, pp=pp, dp=dp, chunks=max(1, _int(r["vpp"], 1)),
                micro_batch=micro, microbatches=microbatches, dp_shard=shard, recompute=recompute,
                autocast=autocast, published_s=tokens_step_gpu / _tokens_per_s_per_gpu(r),
                approx="; ".join(approx), unpriceable=_unpriceable(r, gpu)))
    return out
