"""Every subcommand as a pair: `add_X` declares its arguments, `run_X` turns them into options and calls the library
(prepare, inspect, train, eval, precompute-ref, quickstart, plot; generate in its own module). `prefpack.cli` assembles and dispatches them."""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

from prefpack.commands.generate import add_generate, run_generate
from prefpack.commands.prepare import add_inspect, add_prepare, run_inspect, run_prepare
from prefpack.remote_code import REMOTE_CODE_HELP


def json_line(obj) -> str:
    """One line of strict JSON: a NaN or infinite number (a diverged loss) becomes null, since bare ``NaN`` is not
    JSON and would break whatever parses the line."""
    return json.dumps(_finite(obj), allow_nan=False)


def _finite(obj):
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    if hasattr(obj, "item") and getattr(obj, "ndim", 1) == 0:  # numpy / torch scalars
        return _finite(obj.item())
    return obj


def _err(msg: str) -> None:
    print(msg, file=sys.stderr)


# ---------------------------------------------------------------- train


def add_train(sub) -> None:
    p = sub.add_parser("train", help="train on a prepared store (DPO family)",
                       description="Train with CONFIG.yaml; override any key with key.sub=value "
                       "(e.g. optim.lr=1e-6 loss.beta=0.05).")
    p.add_argument("config", metavar="CONFIG.yaml", help="config file; may be left out when every key is given as an "
                   "override")
    p.add_argument("overrides", nargs="*", metavar="key.sub=value", help="config keys set on the command line, after the file (e.g. optim.lr=1e-6 train.max_steps=100); `prefpack train --help` lists no keys: see docs/config.md")
    p.add_argument("--resume", action="store_true", help="continue from the run folder's newest intact checkpoint "
                   "(each is checked against its checksums; a damaged one is reported and the previous one used)")
    p.add_argument("--allow-config-change", action="store_true",
                   help="with --resume: accept a config that differs from the run's config.yaml in keys that change "
                   "the result (each change is printed and recorded in RUN_DIR/config_changes.jsonl)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                   "(off a terminal: one line per logged step)")
    p.add_argument("--json", action="store_true", help="print the run summary as one JSON line (run folder, final "
                   "model, last step's and last interval's train metrics, evaluations) instead of a table")
    # stops cleanly after N steps, as if interrupted (to test resuming); not for everyday use
    p.add_argument("--stop-after-steps", type=int, default=None, help=argparse.SUPPRESS)


def run_train(args, argv) -> int:
    from prefpack.config import load_config
    from prefpack.distributed import shutdown
    from prefpack.training import TrainingInterrupted, train
    from prefpack.training.guards import TrainingTerminated
    from prefpack.training.resume_check import accept_changes_from_newest_checkpoint, resume_hint

    config, overrides = args.config, list(args.overrides)
    if "=" in config and not Path(config).exists():  # `prefpack train key=value ...` with no file
        config, overrides = None, [config, *overrides]
    cfg = load_config(config, overrides)
    for w in cfg.warnings():
        _err(f"warning: {w}")
    if args.allow_config_change and not args.resume:
        _err("prefpack train: error: --allow-config-change applies to --resume only")
        return 2
    if cfg.rounds.count:  # on-policy rounds: generate, score, train, repeat (prefpack.rounds)
        return _run_rounds(cfg, args, argv)
    try:
        if args.allow_config_change and _is_main_rank():
            accept_changes_from_newest_checkpoint(cfg, log=_err)
        result = train(cfg, resume=args.resume, log=_err, progress=not args.no_progress,
                       stop_after_steps=args.stop_after_steps, allow_plan_change=args.allow_config_change)
    except TrainingInterrupted as stop:
        if _is_main_rank():
            _err(f"{stop}; continue with --resume")
        return 0
    except TrainingTerminated as term:
        if _is_main_rank():
            _err(resume_hint(cfg, argv, f"terminated by signal {term.signum} after step {term.step}"))
        return 128 + term.signum  # 143 for SIGTERM, as if the signal had killed it
    except KeyboardInterrupt:
        if _is_main_rank():
            _err(resume_hint(cfg, argv))
        return 130
    finally:
        shutdown()
    if _is_main_rank():
        print(json_line(result.to_json()) if args.json else result.summary(), flush=True)
    return 0


def _run_rounds(cfg, args, argv) -> int:
    from prefpack.rounds import RoundsInterrupted, run_rounds
    from prefpack.rounds.plan import why_restart
    from prefpack.rounds.stopped import stopped_round, where_stopped
    from prefpack.stop_signal import Terminated
    from prefpack.training.guards import TrainingTerminated
    from prefpack.training.resume_check import resume_hint

    if args.allow_config_change or (args.stop_after_steps is not None and why_restart(cfg) is not None):
        _err("prefpack train: error: --allow-config-change does not apply to rounds, nor --stop-after-steps to rounds "
             "run as separate trainings")
        return 2
    from prefpack.distributed import shutdown

    try:  # under torchrun every rank runs the rounds (prefpack.rounds.ranks); rank 0 alone prints
        result = run_rounds(cfg, resume=args.resume, log=_err, progress=not args.no_progress,
                            stop_after_steps=args.stop_after_steps)
    except RoundsInterrupted as stop:  # --stop-after-steps: the run's steps, counted from round 1's first
        if _is_main_rank():
            _err(f"{stop}; continue with --resume")
        return 0
    except TrainingTerminated as term:  # the round's checkpoint is in RUN_DIR/rounds/NNN/train/checkpoints
        if _is_main_rank():
            what = f"terminated by signal {term.signum} after step {term.step} of round {stopped_round(cfg) + 1}"
            _err(resume_hint(cfg, argv, what, where_stopped(cfg)))
        return 128 + term.signum
    except Terminated as term:  # SIGTERM / Ctrl-C while sampling or scoring: the files end at a whole batch
        _err(resume_hint(cfg, argv, f"terminated by signal {term.signum}", where_stopped(cfg)))
        return 128 + term.signum
    except KeyboardInterrupt:
        if _is_main_rank():
            _err(resume_hint(cfg, argv, where=where_stopped(cfg)))
        return 130
    finally:
        shutdown()
    if _is_main_rank():
        print(json_line(result.to_json()) if args.json else result.summary(), flush=True)
    return 0


def _is_main_rank() -> bool:
    import os

    return os.environ.get("RANK", "0") == "0"


# ---------------------------------------------------------------- eval


def add_eval(sub) -> None:
    from typing import get_args

    from prefpack.config import FDivergence
    from prefpack.loss_params import LOSS_PARAMS

    p = sub.add_parser("eval", help="loss and metrics of a model over every pair (or KTO example) of a store")
    p.add_argument("--model", required=True, help="policy model folder or hub id")
    p.add_argument("--ref", default=None, help="reference model, run beside the policy (default: the store's "
                   "precomputed sidecar if any: its log-probs are the reference, whichever model --model is, e.g. "
                   "the initial model's sidecar for a trained model; else no reference)")
    p.add_argument("--data", required=True, action="append", help="prepared store: pairs, ranked completions, or "
                   "unpaired examples (KTO); give --data several times to score several stores, each in turn")
    p.add_argument("--config", default=None, metavar="RUN_DIR/config.yaml",
                   help="score as that run trained: its loss terms, weights and parameters, precision, packing and "
                   "KTO settings (flags given here override them). Without it, a --model inside a run folder "
                   "(RUN_DIR/final) is scored with that run's objective and loss from RUN_DIR/config.yaml; the "
                   "first line says which loss is used")
    p.add_argument("--loss", default=None, help="loss term(s), comma-separated, e.g. sigmoid or sigmoid,nll "
                   "(default: the --config run's terms, else those of RUN_DIR/config.yaml beside --model, else "
                   "sigmoid for a pair store, kto for an unpaired store or with --kto)")
    for param in LOSS_PARAMS.values():  # every loss.* parameter of the loss registry
        p.add_argument(param.flag, type=float, default=None, help=f"{param.help} (default: the run's, as for --loss, "
                       f"else {'null' if param.default is None else format(param.default, 'g')})")
    p.add_argument("--f-divergence-type", default=None, choices=get_args(FDivergence),
                   help="f-DPO regulariser (default: the --config run's, else reverse_kl = plain DPO)")
    p.add_argument("--use-weighting", action=argparse.BooleanOptionalAction, default=None,
                   help="WPO weighting of each pair's loss (default: the --config run's, else off)")
    p.add_argument("--kto", action="store_true", help="read a pair store as KTO examples (chosen = desirable, "
                   "rejected = undesirable)")
    p.add_argument("--ranked-pairs", default=None, choices=("best_vs_rest", "all_pairs"),
                   help="a ranked store's pairs (default: the --config run's data.ranked_pairs, else best_vs_rest; "
                   "all_pairs for a reward model)")
    p.add_argument("--seed", type=int, default=None, help="seed of the KTO KL pairing (as given to precompute-ref; "
                   "default: the --config run's train.seed, else 0)")
    p.add_argument("--micro-batch-tokens", default="auto", help="tokens per micro-batch (default: auto, from the device)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run (default auto: CUDA when there is a GPU, else CPU)")
    p.add_argument("--dtype", default=None, choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype (default: the --config run's, else auto: bfloat16 on CUDA over float32 "
                   "weights, as training runs)")
    p.add_argument("--allow-tokenizer-mismatch", action="store_true", help="score even when the model's tokenizer differs from the store's (its token ids may mean other things; off by default for that reason)")
    p.add_argument("--trust-remote-code", action="store_true", help=REMOTE_CODE_HELP + " (also on when the --config "
                   "run set model.trust_remote_code)")
    _add_sequence_parallel(p, "(default: the --config run's distributed.sequence_parallel, else 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (on a terminal) or progress lines "
                   "(off a terminal: one every 30 s)")


def _add_sequence_parallel(p, default: str) -> None:
    p.add_argument("--sequence-parallel", type=int, default=None, metavar="N",
                   help="under torchrun: ranks per sequence group, each holding 1/N of every row's tokens, as "
                   f"distributed.sequence_parallel shards training {default}")


def eval_options(args, path: str):
    """``prefpack eval``'s flags for one ``--data`` store, as the library's :class:`EvalOptions`."""
    from prefpack.loss_params import LOSS_PARAMS
    from prefpack.training.scoring import EvalOptions

    return EvalOptions(model=args.model, data=path, config=args.config, loss=args.loss, ref=args.ref, kto=args.kto,
                       seed=args.seed, micro_batch_tokens=args.micro_batch_tokens, device=args.device,
                       dtype=args.dtype, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                       sequence_parallel=args.sequence_parallel,
                       loss_params={name: getattr(args, name) for name in LOSS_PARAMS},
                       f_divergence_type=args.f_divergence_type, use_weighting=args.use_weighting,
                       ranked_pairs=args.ranked_pairs, trust_remote_code=args.trust_remote_code)


def run_eval(args, argv) -> int:
    """Each ``--data`` store scored in turn (the model loaded once per store), exactly as it alone would be."""
    from prefpack.distributed import shutdown
    from prefpack.parallel import start_parallel
    from prefpack.training.scoring import score_store, sequence_parallel_of

    options = [eval_options(args, path) for path in args.data]
    # under torchrun every rank scores a share of each store; a sequence group's ranks the same share, each its
    # token shards (as training does)
    parallel = start_parallel(args.device, sequence_parallel_of(options[0]))
    try:
        say = _err if parallel.is_main else (lambda _line: None)  # set-up lines once, not once per rank
        results = [score_store(opts, parallel=parallel, log=say, progress=not args.no_progress) for opts in options]
    finally:
        shutdown()
    if not parallel.is_main:
        return 0
    for path, result in zip(args.data, results):
        if len(args.data) > 1:
            result = {"data": path, **result}
        if args.json:
            print(json_line(result))
        else:
            for k, v in result.items():
                print(f"{k:<22} {v:.6f}" if isinstance(v, float) else f"{k:<22} {v}")
    return 0


# ---------------------------------------------------------------- precompute-ref


def add_precompute(sub) -> None:
    p = sub.add_parser("precompute-ref", help="write the reference log-probs a run reads beside the store",
                       description="Score every sequence a run reads from the store (each pair's two sides, each "
                       "ranked completion, each KTO example and its fixed KL sequence) once with the reference model, "
                       "laid out as training lays it out, and write the sidecar into the store, tagged with hashes of "
                       "the store and the weights; then train with reference.mode=precomputed and no reference model "
                       "in memory.")
    p.add_argument("--model", required=True, help="reference model folder or hub id")
    p.add_argument("--data", required=True, help="prepared store: pairs, ranked completions, or unpaired examples "
                   "(KTO)")
    p.add_argument("--kto", action="store_true", help="score a pair store as KTO examples (chosen = desirable, "
                   "rejected = undesirable); an unpaired store is always scored as KTO examples")
    p.add_argument("--seed", type=int, default=0, help="KTO: seed of the fixed KL pairing (train.seed of the runs "
                   "that read the sidecar)")
    p.add_argument("--micro-batch-tokens", default="auto", help="tokens per micro-batch (default: auto, from the device)")
    p.add_argument("--chunk-size", default="auto", help="rows per chunk of the head (default: auto, from the device)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="where to run (default auto: CUDA when there is a GPU, else CPU)")
    p.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                   help="compute dtype (default auto: bfloat16 on CUDA over float32 weights, float32 on CPU; use the dtype the runs that read the sidecar will train in)")
    p.add_argument("--allow-tokenizer-mismatch", action="store_true", help="score even when the model's tokenizer differs from the store's (its token ids may mean other things; off by default for that reason)")
    p.add_argument("--trust-remote-code", action="store_true", help=REMOTE_CODE_HELP)
    p.add_argument("--overwrite", action="store_true", help="score again even when the store's sidecar was written "
                   "with the same reference weights, store and settings (without it such a sidecar is kept, said "
                   "in one line)")
    _add_sequence_parallel(p, "(default 1)")


def run_precompute(args, argv) -> int:
    from prefpack.distributed import shutdown
    from prefpack.parallel import start_parallel
    from prefpack.training.precompute import PrecomputeOptions, precompute_reference

    opts = PrecomputeOptions(model=args.model, data=args.data, kto=args.kto, seed=args.seed,
                             micro_batch_tokens=_budget("--micro-batch-tokens", args.micro_batch_tokens),
                             chunk_size=_budget("--chunk-size", args.chunk_size), device=args.device,
                             dtype=args.dtype, allow_tokenizer_mismatch=args.allow_tokenizer_mismatch,
                             trust_remote_code=args.trust_remote_code, overwrite=args.overwrite)
    # under torchrun every rank scores a share of the store; a sequence group's ranks the same share, each its token
    # shards (as training does)
    parallel = start_parallel(args.device, 1 if args.sequence_parallel is None else args.sequence_parallel)
    try:
        summary = precompute_reference(opts, parallel=parallel, log=_err)
        parallel.barrier()  # no rank leaves while another is still in a collective
    finally:
        shutdown()
    if parallel.is_main:
        print(json_line(summary))
    return 0


def _budget(flag: str, value: str) -> int | str:
    from prefpack.config import ConfigError

    if value == "auto":
        return value
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"{flag} must be a positive integer or auto, got {value!r}")
    return int(value)


# ---------------------------------------------------------------- quickstart and plot


def add_quickstart(sub) -> None:
    p = sub.add_parser("quickstart", help="the whole pipeline on a small bundled task, no downloads (about a minute "
                       "on 2 CPU cores, on one torch thread)",
                       description="--model-size toy (default): the whole pipeline on generated reviews, in "
                       "runs/quickstart. --model-size small: only a starting model for your own data (README's "
                       "'Train your own'): a 4-layer Llama with 2,048 positions and its tokenizer, trained as a "
                       "language model on the bundled hh sample (30 steps: about 25 s on 2 quiet CPU cores, minutes on busy ones), in "
                       "runs/quickstart-small/model.")
    p.add_argument("--model-size", choices=("toy", "small"), default="toy",
                   help="toy: the DPO demo (default); small: build a model for real data and stop")
    p.add_argument("--images", action="store_true",
                   help="write README's 'Images' example and stop: generated image pairs, a processor folder and a "
                   "tiny Qwen2-VL (default folder runs/quickstart-images)")
    p.add_argument("--task", choices=("reviews", "arithmetic"), default="reviews",
                   help="reviews: the DPO demo (default); arithmetic: write the verifiable-reward example for "
                   "on-policy rounds and stop (additions A+B=, an exact-answer reward.py, a warm-started tiny model, "
                   "DPO and GRPO rounds configs; default folder runs/arithmetic; docs/on-policy.md)")
    p.add_argument("--output-dir", default=None, help="default: runs/quickstart (toy), runs/quickstart-small (small), "
                   "runs/arithmetic (--task arithmetic)")
    p.add_argument("--steps", type=int, default=None,
                   help="toy: stop DPO after this many steps (default: one epoch); small: language-model "
                   "training steps (default 30); arithmetic: the warm start's SFT steps (default 120)")
    p.add_argument("--data", default=None, help="small: conversations to build the tokenizer and train on (pairs "
                   ".jsonl[.gz] or a text column; default: the bundled hh sample)")
    p.add_argument("--seed", type=int, default=0, help="seed of the data, the model's initial weights and the training order (default 0)")
    p.add_argument("--overwrite", action="store_true", help="replace the output folder when an earlier quickstart "
                   "wrote it (its trained model included); without it an existing folder is refused")


def run_quickstart(args, argv) -> int:
    from prefpack.quickstart import IMAGES_DIR, SMALL_MODEL_DIR, build_image_example, build_small_model
    from prefpack.quickstart import run_quickstart as go

    if args.task == "arithmetic":
        from prefpack.arithmetic import ARITHMETIC_DIR, WARM_STEPS, build_arithmetic
        from prefpack.errors import PrefpackError

        if args.images or args.model_size != "toy" or args.data is not None:
            raise PrefpackError("--task arithmetic goes alone (with --output-dir, --steps, --seed); it builds its own "
                                "model and data")
        build_arithmetic(args.output_dir or ARITHMETIC_DIR, seed=args.seed,
                         warm_steps=WARM_STEPS if args.steps is None else args.steps, overwrite=args.overwrite,
                         log=print)
        return 0
    if args.images:
        build_image_example(args.output_dir or IMAGES_DIR, seed=args.seed, overwrite=args.overwrite, log=print)
        return 0
    if args.model_size == "small":
        build_small_model(args.output_dir or SMALL_MODEL_DIR, steps=args.steps, seed=args.seed, data=args.data,
                          overwrite=args.overwrite, log=print)
        return 0
    if args.data is not None:
        from prefpack.errors import PrefpackError

        raise PrefpackError("--data goes with --model-size small (the toy quickstart generates its own data)")
    go(args.output_dir or "runs/quickstart", steps=args.steps, seed=args.seed, overwrite=args.overwrite, log=print)
    return 0


def add_plot(sub) -> None:
    p = sub.add_parser("plot", help="draw RUN_DIR/curves.png from RUN_DIR/metrics.jsonl")
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run folder (run.output_dir) holding metrics.jsonl")


def run_plot(args, argv) -> int:
    from prefpack.plot import plot_run

    print(plot_run(args.run_dir))
    return 0


from prefpack.commands.score import add_score, run_score  # noqa: E402

COMMANDS = {
    "prepare": (add_prepare, run_prepare),
    "inspect": (add_inspect, run_inspect),
    "train": (add_train, run_train),
    "eval": (add_eval, run_eval),
    "precompute-ref": (add_precompute, run_precompute),
    "quickstart": (add_quickstart, run_quickstart),
    "plot": (add_plot, run_plot),
    "generate": (add_generate, run_generate),
    "score": (add_score, run_score),
}

