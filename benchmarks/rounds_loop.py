"""Several on-policy rounds on CPU, in one training process against each round run as a separate training, on the
quickstart task of ``benchmarks/rounds.py``: seconds per round by phase (generate, score, train), whole-run seconds,
and how often a model was read from disk (``from_pretrained`` calls: the policy, its copied reference, and, when
each round is a separate training, each round's policy, reference and sampler again).

Both sides run ``rounds.optimizer=reset`` (the same arithmetic: their files are equal byte for byte,
``tests/test_rounds_live.py``), one after the other in this process, ``--threads`` torch threads.

With ``--vllm-command CMD`` (a ``vllm serve {model} --port {port} ...`` command in vLLM's own environment, as
docs/generate.md builds it) both sides sample through vLLM: one server for the run, given each round's weights in
place (the command gets ``--worker-extension-cls``; dev mode and ``PYTHONPATH`` are set here), against a server
started on each round's policy; ``sampler starts`` counts them. The model is then a 2-layer Llama with head size 64
(vLLM's CPU attention has no smaller kernel), as tests/test_rounds_vllm_real.py builds it.

``--online N`` also runs N rounds of one step each (8 prompts a round, ``rounds.save_each_round=false``; with
``--overlap`` and vLLM, ``rounds.overlap``) and prints the mean seconds a round: the seconds per sync.

    python benchmarks/rounds_loop.py [--rounds 3] [--prompts 32] [--k 4] [--max-new-tokens 8] [--steps 4]
                                     [--threads 1] [--vllm-command CMD] [--online N [--overlap]]

Prints a table and, last, one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

SIDES = {"one process": ["rounds.in_process=true"], "a training per round": ["rounds.in_process=false"]}
ONLINE = "online (a round a step)"  # --online N: N rounds of one step, rounds.save_each_round=false


def run_side(root: Path, name: str, args) -> dict:
    from transformers import PreTrainedModel

    from prefpack.config import load_config
    from prefpack.generation import server as server_module
    from prefpack.generation.vllm_worker import EXTENSION
    from prefpack.rounds import run_rounds

    vllm = []
    if args.vllm_command:
        live = name != "a training per round"
        vllm = ["rounds.engine=vllm",
                f"rounds.vllm_command={args.vllm_command}" + (f" --worker-extension-cls {EXTENSION}" if live else "")]

    run = root / name.replace(" ", "-")
    cfg = load_config(None, [
        f"model.name_or_path={root / 'init'}", "train.global_batch_pairs=8", "optim.lr=1e-3", "loss.beta=0.1",
        f"run.output_dir={run}", "run.report_to=none", "run.plot=false", "run.save_every=0",
        f"rounds.count={args.rounds}", f"rounds.prompts={root / 'prompts.jsonl'}", f"rounds.samples_per_prompt={args.k}",
        f"rounds.max_new_tokens={args.max_new_tokens}", "rounds.batch_size=16", "rounds.optimizer=reset",
        f"rounds.reward_fn={root / 'reward.py'}:reward", f"rounds.steps_per_round={args.steps}",
        *SIDES.get(name, []), *vllm, *(online_keys(args) if name == ONLINE else [])])
    loads, starts = [], []
    original = PreTrainedModel.from_pretrained.__func__
    start = server_module.VllmServer.start

    def counted_start(self, *a, **kw):
        starts.append(self.command)
        return start(self, *a, **kw)

    server_module.VllmServer.start = counted_start

    def counted(cls, path, *a, **kw):
        loads.append(str(path))
        return original(cls, path, *a, **kw)

    PreTrainedModel.from_pretrained = classmethod(counted)
    t0 = time.perf_counter()
    try:
        result = run_rounds(cfg, log=lambda *_: None, progress=False)
    finally:
        PreTrainedModel.from_pretrained = classmethod(original)
        server_module.VllmServer.start = start
    seconds = time.perf_counter() - t0
    rounds = [{"round": m["round"] + 1, **{p: m.get(f"seconds/{p}") for p in ("generate", "score", "train")},
               "waited": m.get("seconds/generate_waited")} for m in result.rounds]
    return {"side": name, "seconds": seconds, "model_loads": len(loads), "sampler_starts": len(starts), "rounds": rounds,
            "reward_mean": [m["reward/mean"] for m in result.rounds]}


def online_keys(args) -> list[str]:
    """``--online`` rounds of one step each over 8 prompts, no model nor checkpoint per round (the last one's)."""
    return [f"rounds.count={args.online}", "rounds.steps_per_round=1", "rounds.save_each_round=false",
            "rounds.prompts_per_round=8", "rounds.optimizer=keep"] + (["rounds.overlap=true"] if args.overlap else [])


def vllm_sized_model(folder: Path) -> None:
    """The task's model rebuilt with head size 64 (vLLM's CPU attention has no kernel for smaller heads), float32."""
    import torch
    from transformers import AutoConfig, LlamaConfig, LlamaForCausalLM

    vocab = AutoConfig.from_pretrained(folder).vocab_size
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                                 tie_word_embeddings=False)).save_pretrained(folder)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=8)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--vllm-command", default=None)
    ap.add_argument("--online", type=int, default=0, help="also N online rounds of one step (seconds per sync)")
    ap.add_argument("--overlap", action="store_true", help="the online rounds with rounds.overlap (vLLM)")
    ap.add_argument("--workdir", default=None, help="keep the runs (and a server's log) here instead of a temporary "
                    "folder")
    args = ap.parse_args()
    import torch

    from benchmarks.rounds import build_task

    torch.set_num_threads(args.threads)
    if args.vllm_command:
        os.environ.update(VLLM_SERVER_DEV_MODE="1", PYTHONPATH=str(REPO))  # the live server's extension
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(args.workdir or tmp)
        root.mkdir(parents=True, exist_ok=True)
        build_task(root, args.prompts)
        if args.vllm_command:
            vllm_sized_model(root / "init")
        sides = [run_side(root, name, args) for name in [*SIDES, *([ONLINE] if args.online else [])]]
    print(f"{'side':<22} {'round':>5} {'generate s':>11} {'score s':>8} {'train s':>8}")
    for side in sides:
        for r in side["rounds"]:
            print(f"{side['side']:<22} {r['round']:>5} {r['generate'] or 0:>11.2f} {r['score'] or 0:>8.2f} "
                  f"{r['train'] or 0:>8.2f}")
    print()
    print(f"{'side':<22} {'whole run s':>12} {'model loads':>12} {'sampler starts':>15}")
    for side in sides:
        print(f"{side['side']:<22} {side['seconds']:>12.2f} {side['model_loads']:>12} {side['sampler_starts']:>15}")
    if args.online:
        online = sides[-1]["rounds"][1:]  # the first round's sampling starts the server (vLLM)
        per = {p: sum(r[p] or 0 for r in online) / len(online) for p in ("generate", "score", "train", "waited")}
        print(f"\nonline, mean over rounds 2-{args.online}: generate (sync + sampling) {per['generate']:.3f} s "
              f"(waited for: {per['waited']:.3f} s), score {per['score']:.3f} s, train {per['train']:.3f} s a round; "
              f"whole run {sides[-1]['seconds']:.1f} s")
        sides[-1]["per_round_mean"] = per
    same = sides[0]["reward_mean"] == sides[1]["reward_mean"]
    print(f"\nthe same sample rewards every round: {same}")
    print(json.dumps({"args": vars(args), "sides": sides, "same_rewards": same}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
