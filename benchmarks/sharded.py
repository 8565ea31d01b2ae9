"""A sharded decoder (FSDP2) trained with a cached loss: memory, traffic and time per process.

A Qwen2-style decoder (``transformers.Qwen2Config``, random init, saved to a temp dir) wrapped as a
SentenceTransformer with last-token pooling and a left-padding word-level tokenizer, sharded with
FSDP2 (``fully_shard`` per decoder layer and at the root) over ``--world`` gloo processes spawned by
this script, trained with ``CachedMNRLoss(mini_batch_size=8, gather_across_devices=True)`` on
(anchor, positive) pairs of ``--words`` random words each, fully fine-tuned (``full``) or with LoRA
adapters on every linear layer of the decoder (``lora``: ``model.add_adapter(LoraConfig(...))``,
peft). ``--batches`` are global batch sizes; each process holds ``batch / world`` rows per column.

Per process and per step (a step is the loss's forward and backward: no optimizer):

* peak memory: the peak of live tensor bytes allocated during the step
  (``tests.support.memory.PeakMemory``, a dispatch mode: deterministic, CPU or GPU, plus the
  storages FSDP2 grows in place for its gathered parameters, see :func:`step_memory`), measured on
  the step after a warm-up, gradients set to None before it (their shards are counted). Not counted:
  what existed before the step (the process's parameter shards, ``param_shard_mib`` in the JSON).
* bytes sent: the input tensor of every ``torch.distributed`` collective the process calls during
  the step (FSDP2's all-gathers and reduce-scatters, the loss's own all-gathers), summed; this is the
  payload handed to the collective, not the bytes on the wire.
* time: wall-clock of one step after the warm-up (shared 2-core machine: read ratios, not absolutes).

Traffic against the per-replay baseline: at ``--traffic-batch`` (default: 16 mini-batches per process
per step), the same step once more with the engine's gradient-sync switch disabled
(``st_cached_losses.engine.gradcache.unsynced`` replaced by a no-op), so that every replay's backward
reduce-scatters: what a cached loss without the switch does. Both runs end with the same gradients
(checked on a sample of every parameter shard). And a third variant, ``ours-gathered``: ours with the
engine's ``keep_params_unsharded=True`` (every group's parameters all-gathered once, by the step's
first forward, and kept to the end of the step: one all-gather and one reduce-scatter per group per
step, for the memory of the full parameters). ``--reshard`` sets the decoder layers'
``reshard_after_forward``: ``true`` (FSDP2's default: parameters all-gathered again for every forward
and every backward), ``false`` (kept from a forward to its backward, resharded after the backward) or
``both`` (the traffic comparison under each).

Run: ``.venv/bin/python benchmarks/sharded.py`` (the issue's sizes: ~100M parameters, batches 64 ...
4096; hours on a CPU) or scaled down, e.g. the committed results::

    .venv/bin/python benchmarks/sharded.py --params 25m --batches 128 --modes full,lora \\
        --sweep-params 8m --sweep-batches 64,128,256,512

Writes ``benchmarks/results/sharded.{md,json}`` (``--out`` to change).
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

from _common import ROOT

os.environ.setdefault("HF_HUB_OFFLINE", "1")

#: (hidden, layers, attention heads, key/value heads, MLP width, vocabulary) of a Qwen2-style decoder
PRESETS = {
    "100m": (768, 12, 12, 2, 2048, 32000),
    "25m": (512, 6, 8, 2, 1408, 16000),
    "8m": (256, 4, 4, 2, 704, 8000),
    "1m": (64, 2, 4, 2, 176, 2000),
}

#: the argument holding what a collective sends, by function
SENT_ARG = {
    "all_gather_single": "input_tensor",
    "all_gather_into_tensor": "input_tensor",
    "reduce_scatter_single": "input",
    "reduce_scatter_tensor": "input",
    "all_gather": "tensor",
    "all_reduce": "tensor",
    "broadcast": "tensor",
    "isend": "tensor",
    "send": "tensor",
}


class Traffic:
    """Calls and bytes sent per ``torch.distributed`` function in this process, by wrapping them."""

    def __init__(self) -> None:
        import torch.distributed as dist

        self.calls: dict[str, int] = {}
        self.bytes: dict[str, int] = {}
        for name, arg in SENT_ARG.items():
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn, arg))

    def _wrap(self, name, fn, arg):
        sig = inspect.signature(fn)

        def counted(*args, **kwargs):
            tensor = sig.bind(*args, **kwargs).arguments.get(arg)
            self.calls[name] = self.calls.get(name, 0) + 1
            self.bytes[name] = self.bytes.get(name, 0) + tensor.numel() * tensor.element_size()
            return fn(*args, **kwargs)

        return counted

    def reset(self) -> dict:
        out = {"calls": dict(self.calls), "bytes": dict(self.bytes)}
        self.calls.clear()
        self.bytes.clear()
        return out


def step_memory():
    """``PeakMemory`` that also counts the storages FSDP2 resizes in place.

    FSDP2 keeps its unsharded parameters (and reused all-gather buffers) in persistent storages that it
    grows and frees with ``storage.resize_`` (``alloc_storage`` / ``free_storage`` in
    torch/distributed/fsdp/_fully_shard/_fsdp_param.py): no new storage, so the dispatch mode alone
    would not see the gathered parameters. Those two functions are wrapped while the block runs."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group

    from tests.support.memory import PeakMemory

    class StepMemory(PeakMemory):
        def __enter__(self):
            self._resized: dict[int, int] = {}
            self._orig = (_fsdp_param.alloc_storage, _fsdp_param.free_storage)
            alloc, free = self._orig

            def counted_alloc(tensor):
                before = tensor.untyped_storage().nbytes()
                alloc(tensor)
                grown = tensor.untyped_storage().nbytes() - before
                if grown > 0:
                    self._resized[id(tensor)] = self._resized.get(id(tensor), 0) + grown
                    self.live += grown
                    self.peak_bytes = max(self.peak_bytes, self.live)

            def counted_free(tensor):
                free(tensor)
                # only what grew inside the block (like PeakMemory: storages from before are not counted)
                self.live -= self._resized.pop(id(tensor), 0)

            _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = counted_alloc
            _fsdp_param.free_storage = counted_free
            return super().__enter__()

        def __exit__(self, *exc):
            _fsdp_param.alloc_storage = _fsdp_param_group.alloc_storage = self._orig[0]
            _fsdp_param.free_storage = self._orig[1]
            return super().__exit__(*exc)

    return StepMemory()


def make_decoder(path: Path, preset: tuple[int, ...], seed: int = 0) -> int:
    """Write a random Qwen2 decoder and a word-level tokenizer to ``path``; returns the parameter count."""
    import torch
    from transformers import BertTokenizerFast, Qwen2Config, Qwen2Model

    from tests.support.tiny_model import WORDS

    hidden, layers, heads, kv_heads, mlp, vocab_size = preset
    specials = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    vocab = {tok: i for i, tok in enumerate(dict.fromkeys([*specials, *WORDS]))}
    tokenizer = BertTokenizerFast(vocab=vocab, do_lower_case=True, padding_side="left")
    config = Qwen2Config(
        vocab_size=max(vocab_size, len(vocab)),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=mlp,
        max_position_embeddings=512,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = Qwen2Model(config)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return sum(p.numel() for p in model.parameters())


def load_model(path: str, mode: str):
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertTokenizerFast

    transformer = Transformer(path, max_seq_length=256)
    # AutoTokenizer would pick Qwen2's tokenizer class for this config: the word-level one
    transformer.processor = BertTokenizerFast.from_pretrained(path)
    pooling = Pooling(transformer.get_embedding_dimension(), pooling_mode="lasttoken")
    model = SentenceTransformer(modules=[transformer, pooling], device="cpu")
    if mode == "lora":
        from peft import LoraConfig

        targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
        model.add_adapter(LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=targets))
    return model


def shard(model, reshard_after_forward: bool):
    from torch.distributed.fsdp import fully_shard

    for layer in model[0].auto_model.layers:
        fully_shard(layer, reshard_after_forward=reshard_after_forward)
    fully_shard(model)
    return model


def texts(n: int, words: int, seed: int) -> list[str]:
    import random

    from tests.support.tiny_model import WORDS

    rng = random.Random(seed)
    return [" ".join(rng.choice(WORDS) for _ in range(words)) for _ in range(n)]


def grad_sample(model):
    """Every 997th element of this process's gradient shards (same layout on every run)."""
    import torch

    parts = []
    for p in model.parameters():
        if p.grad is not None:
            g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
            parts.append(g.detach().flatten()[::997].clone())
    return torch.cat(parts) if parts else torch.zeros(0)


def _worker(rank: int, world: int, path: str, cfg: dict) -> list[dict]:
    import torch

    from st_cached_losses import CachedMNRLoss

    torch.set_num_threads(cfg["threads"])
    traffic = Traffic()
    rows = []
    for mode in cfg["modes"]:
        for reshard in cfg["reshard"]:
            batches = cfg["batches"] if reshard == cfg["reshard"][0] else []
            compare = cfg["traffic_batch"]
            todo = sorted(set(batches) | ({compare} if compare else set()))
            model = load_model(path, mode)
            trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
            total = sum(p.numel() for p in model.parameters())
            shard(model, reshard)
            shard_bytes = sum(
                (p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()
                for p in model.parameters()
            )
            loss = CachedMNRLoss(model, mini_batch_size=cfg["mini_batch"], gather_across_devices=True)
            for batch in todo:
                local = batch // world
                cols = [texts(batch, cfg["words"], seed=s) for s in (1, 2)]
                feats = [model.preprocess(c[rank * local : (rank + 1) * local]) for c in cols]
                per_process = sum(len(loss.cache.plan(k, f)) for k, f in enumerate(feats))
                variants = ["ours"] + (["per-replay", "ours-gathered"] if batch == compare else [])
                for variant in variants:
                    value, mem, seconds, sent = measure(model, loss, feats, variant, traffic)
                    rows.append(
                        {
                            "mode": mode,
                            "reshard_after_forward": reshard,
                            "variant": variant,
                            "batch": batch,
                            "in_sweep": batch in batches,
                            "mini_batches_per_process": per_process,
                            "peak_mib": mem.peak_bytes / 2**20,
                            "sent_mib": sum(sent["bytes"].values()) / 2**20,
                            "sent_by_call_mib": {k: v / 2**20 for k, v in sent["bytes"].items()},
                            "calls": sent["calls"],
                            "seconds": seconds,
                            "loss": value.item(),
                            "grad_sample": grad_sample(model).tolist(),
                            "params": total,
                            "trainable": trainable,
                            "param_shard_mib": shard_bytes / 2**20,
                        }
                    )
                    if rank == 0:
                        r = rows[-1]
                        print(
                            f"  {mode} raf={reshard} {variant} B={batch}: {r['seconds']:.1f} s, "
                            f"peak {r['peak_mib']:.0f} MiB, sent {r['sent_mib']:.0f} MiB",
                            flush=True,
                        )
            del model, loss
    return rows


def measure(model, loss, feats, variant: str, traffic: Traffic):
    """A warm-up step, a step under PeakMemory, a timed step whose collectives are counted."""
    import time

    import st_cached_losses.engine.gradcache as gradcache

    def step():
        value = loss(feats, None)
        value.backward()
        return value

    # the engine's option (off by default): FSDP2 parameters kept unsharded for the whole step
    loss.keep_params_unsharded = variant == "ours-gathered"

    patch = (
        # the engine's gradient-sync switch off: every replay's backward reduce-scatters
        _patched(gradcache, "unsynced", lambda m: contextlib.nullcontext())
        if variant == "per-replay"
        else contextlib.nullcontext()
    )
    with patch:
        model.zero_grad(set_to_none=True)
        step()
        model.zero_grad(set_to_none=True)
        with step_memory() as mem:
            step()
        model.zero_grad(set_to_none=True)
        traffic.reset()
        start = time.perf_counter()
        value = step()
        seconds = time.perf_counter() - start
        sent = traffic.reset()
    return value, mem, seconds, sent


@contextlib.contextmanager
def _patched(module, name, value):
    old = getattr(module, name)
    setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, old)


def run(preset_name: str, preset, args, batches: list[int], traffic_batch: int | None, reshard) -> dict:
    from tests.support.dist_utils import run_distributed

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "decoder"
        n_params = make_decoder(path, preset)
        print(
            f"{preset_name}: {n_params / 1e6:.1f}M parameters, batches {batches}, compare at {traffic_batch}"
        )
        cfg = {
            "modes": args.modes.split(","),
            "reshard": reshard,
            "batches": batches,
            "traffic_batch": traffic_batch,
            "mini_batch": args.mini_batch,
            "words": args.words,
            "threads": args.threads,
        }
        per_rank = run_distributed(_worker, args.world, str(path), cfg, timeout=args.timeout)
    return {"preset": preset_name, "config": list(preset), "params": n_params, "per_rank": per_rank}


def summarise(result: dict) -> list[dict]:
    """One row per (mode, reshard, variant, batch): the largest value over processes."""
    rows = []
    per_rank = result["per_rank"]
    for i, r0 in enumerate(per_rank[0]):
        rs = [pr[i] for pr in per_rank]
        row = {k: r0[k] for k in ("mode", "reshard_after_forward", "variant", "batch", "in_sweep")}
        row.update(
            preset=result["preset"],
            params=r0["params"],
            trainable=r0["trainable"],
            mini_batches_per_process=max(r["mini_batches_per_process"] for r in rs),
            peak_mib=max(r["peak_mib"] for r in rs),
            sent_mib=max(r["sent_mib"] for r in rs),
            reduce_scatter_mib=max(r["sent_by_call_mib"].get("reduce_scatter_single", 0.0) for r in rs),
            all_gather_mib=max(r["sent_by_call_mib"].get("all_gather_single", 0.0) for r in rs),
            reduce_scatters=max(r["calls"].get("reduce_scatter_single", 0) for r in rs),
            all_gathers=max(r["calls"].get("all_gather_single", 0) for r in rs),
            seconds=max(r["seconds"] for r in rs),
            loss=sum(r["loss"] for r in rs) / len(rs),
            param_shard_mib=max(r["param_shard_mib"] for r in rs),
            _grads=[r["grad_sample"] for r in rs],
        )
        rows.append(row)
    return rows


def compare(rows: list[dict]) -> list[dict]:
    """Per traffic batch: ours, ours with parameters kept gathered, and the per-replay baseline."""
    import torch

    def key(r: dict) -> tuple:
        return (r["preset"], r["mode"], r["reshard_after_forward"], r["batch"])

    out = []
    for per in (r for r in rows if r["variant"] == "per-replay"):
        found = {r["variant"]: r for r in rows if key(r) == key(per)}
        b = torch.tensor([x for g in per["_grads"] for x in g])
        entry = {
            "preset": per["preset"],
            "mode": per["mode"],
            "reshard_after_forward": per["reshard_after_forward"],
            "batch": per["batch"],
            "mini_batches_per_process": per["mini_batches_per_process"],
        }
        for variant, r in found.items():
            a = torch.tensor([x for g in r["_grads"] for x in g])
            entry[variant] = {
                "sent_mib": r["sent_mib"],
                "ratio": r["sent_mib"] / per["sent_mib"],
                "reduce_scatter_mib": r["reduce_scatter_mib"],
                "all_gather_mib": r["all_gather_mib"],
                "reduce_scatters": r["reduce_scatters"],
                "all_gathers": r["all_gathers"],
                "peak_mib": r["peak_mib"],
                "seconds": r["seconds"],
                # against the per-replay baseline, on a sample of every gradient shard
                "grad_rel_diff": float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)),
            }
        out.append(entry)
    return out


def write(results: list[dict], args, argv: list[str], elapsed: float) -> None:
    rows = [r for res in results for r in summarise(res)]
    comparisons = compare(rows)
    for r in rows:
        r.pop("_grads")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = " ".join([".venv/bin/python", "benchmarks/sharded.py", *argv])
    header = {
        "command": command,
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU cores, torch threads per process {args.threads}",
        "world": args.world,
        "mini_batch_size": args.mini_batch,
        "words_per_text": args.words,
        "elapsed_s": elapsed,
        "models": {res["preset"]: {"config": res["config"], "params": res["params"]} for res in results},
    }
    Path(f"{out}.json").write_text(json.dumps({**header, "rows": rows, "comparisons": comparisons}, indent=1))

    lines = [
        "# Sharded decoder (FSDP2) with a cached loss: memory, traffic and time per process",
        "",
        f"Command: `{command}` ({elapsed / 60:.1f} min). {header['machine']}; {args.world} gloo processes; "
        f"CachedMNRLoss(mini_batch_size={args.mini_batch}, gather_across_devices=True); "
        f"(anchor, positive) pairs of {args.words} random words ({args.words + 2} tokens).",
        "",
        *(
            []
            if not argv
            else [
                "Not the issue's full sizes (the defaults: `--params 100m --batches 64,128,...,4096`): only "
                "what the command above names ran.",
                "",
            ]
        ),
        "Models (hidden, layers, heads, kv heads, MLP width, vocabulary): "
        + "; ".join(
            f"`{res['preset']}` = {tuple(res['config'])}, {res['params'] / 1e6:.1f}M parameters"
            for res in results
        )
        + ". FSDP2: `fully_shard` per decoder layer and at the root. LoRA: r=16 on every linear layer.",
        "",
        "A step = the loss's forward + backward (no optimizer). Peak = live tensor bytes allocated during "
        "the step (PeakMemory, plus the storages FSDP2 grows in place for gathered parameters; the "
        "process's parameter shards, held before the step, not counted). "
        "Sent = input tensors of every torch.distributed collective the process called in the step. "
        "The largest value over processes.",
        "",
        "## Memory and time against batch size (ours)",
        "",
        "| model | mode | reshard after fwd | global batch | mini-batches / process | peak (MiB) | sent (MiB) "
        "| reduce-scatters | step (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    sweep = [r for r in rows if r["variant"] == "ours" and r["in_sweep"]]
    for r in sweep:
        lines.append(
            f"| {r['preset']} | {r['mode']} | {r['reshard_after_forward']} | {r['batch']} | "
            f"{r['mini_batches_per_process']} | {r['peak_mib']:.1f} | {r['sent_mib']:.1f} | "
            f"{r['reduce_scatters']} | {r['seconds']:.2f} |"
        )
    lines.append("")
    for key in sorted({(r["preset"], r["mode"], r["reshard_after_forward"]) for r in sweep}):
        peaks = [r["peak_mib"] for r in sweep if (r["preset"], r["mode"], r["reshard_after_forward"]) == key]
        bs = [r["batch"] for r in sweep if (r["preset"], r["mode"], r["reshard_after_forward"]) == key]
        if len(peaks) > 1:
            lines.append(
                f"- {key[0]} {key[1]} (reshard {key[2]}): peak max/min over batches {min(bs)}..{max(bs)} = "
                f"{max(peaks) / min(peaks):.3f} (target <= 1.2)"
            )
    lines += [
        "",
        "## Traffic: ours (one reduce-scatter per step) vs a reduce-scatter per replay",
        "",
        "Per process and step: MiB sent (all-gather + reduce-scatter + the loss's own), the ratio to the "
        "per-replay baseline (target <= 0.25), all-gather / reduce-scatter calls, peak memory, step time, "
        "and the largest gradient difference from the baseline (relative to its largest gradient).",
        "",
        "| model | mode | reshard after fwd | batch | mini-batches / process | variant | sent (MiB) "
        "| ratio | all-gather (MiB) | reduce-scatter (MiB) | all-gathers / reduce-scatters | peak (MiB) "
        "| step (s) | grad diff |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in comparisons:
        for variant in ("ours", "ours-gathered", "per-replay"):
            v = c.get(variant)
            if v is None:
                continue
            lines.append(
                f"| {c['preset']} | {c['mode']} | {c['reshard_after_forward']} | {c['batch']} | "
                f"{c['mini_batches_per_process']} | {variant} | {v['sent_mib']:.1f} | {v['ratio']:.3f} | "
                f"{v['all_gather_mib']:.1f} | {v['reduce_scatter_mib']:.1f} | "
                f"{v['all_gathers']} / {v['reduce_scatters']} | {v['peak_mib']:.1f} | {v['seconds']:.2f} | "
                f"{v['grad_rel_diff']:.1e} |"
            )
    Path(f"{out}.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--params",
        default="100m",
        choices=sorted(PRESETS),
        help="model for --batches and the traffic comparison",
    )
    parser.add_argument(
        "--config",
        default=None,
        help="instead of a preset: hidden,layers,heads,kv_heads,mlp,vocab (e.g. 768,12,12,2,2048,32000)",
    )
    parser.add_argument("--batches", default="64,128,256,512,1024,2048,4096", help="global batch sizes")
    parser.add_argument(
        "--traffic-batch", type=int, default=None, help="default: 16 mini-batches per process"
    )
    parser.add_argument(
        "--sweep-params",
        default=None,
        choices=sorted(PRESETS),
        help="a second (smaller) model for the batch sweep; --params then runs at --batches only",
    )
    parser.add_argument("--sweep-batches", default="64,128,256,512", help="batches of --sweep-params")
    parser.add_argument("--modes", default="full,lora")
    parser.add_argument("--reshard", default="true", choices=["true", "false", "both"])
    parser.add_argument("--mini-batch", type=int, default=8)
    parser.add_argument("--words", type=int, default=14, help="words per text (+2 special tokens)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--timeout", type=float, default=6 * 3600)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "sharded"))
    args = parser.parse_args(argv)

    # 16 mini-batches per process per step: 2 columns x 8 mini-batches
    traffic_batch = args.traffic_batch or 8 * args.mini_batch * args.world
    reshard = {"true": [True], "false": [False], "both": [True, False]}[args.reshard]
    preset = tuple(int(x) for x in args.config.split(",")) if args.config else PRESETS[args.params]
    name = "custom" if args.config else args.params
    start = time.monotonic()
    results = [run(name, preset, args, [int(b) for b in args.batches.split(",")], traffic_batch, reshard)]
    if args.sweep_params:
        sweep = [int(b) for b in args.sweep_batches.split(",")]
        results.append(run(args.sweep_params, PRESETS[args.sweep_params], args, sweep, None, [True]))
    write(results, args, argv, time.monotonic() - start)


if __name__ == "__main__":
    main()
