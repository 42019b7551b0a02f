"""The model card of a final model: ``final/README.md`` in the convention the peers follow (TRL writes one for every
trained model): a YAML header the hub reads (``base_model``, ``datasets``, ``library_name``, ``license``, ``tags``)
and a body saying how the model was trained (the method and its citation, from the loss registries), with which main
settings (``config.yaml`` beside ``final/``), with what last evaluation (``metrics.jsonl``), by which versions of the
frameworks, and how to load it (the usage snippet for a reward model is the one that gives prefpack's own scores).

A card prefpack wrote carries :data:`MARKER`; ``save_final`` writes it again at each save, and keeps any
``README.md`` without the marker (the user's own) instead of writing one. A LoRA run's ``final/adapter/`` gets its own
card (``library_name: peft``). Writing a card never fails a save: a problem is one warning line.
"""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

__all__ = ["MARKER", "CardFacts", "card_facts", "is_prefpack_card", "reward_chat_template", "write_cards"]

MARKER = "<!-- prefpack model card: written again at each save; delete this line to keep your edits -->"
CARD = "README.md"

_BRADLEY_TERRY = ('Bradley & Terry 1952, "Rank Analysis of Incomplete Block Designs: I. The Method of Paired '
                  'Comparisons"', "")
_INSTRUCTGPT = ('Ouyang et al. 2022, "Training language models to follow instructions with human feedback"',
                "2203.02155")
_PAPER = re.compile(r'^(?P<authors>.+?) (?P<year>\d{4}), "(?P<title>[^"]+)"(?P<rest>.*)$')
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CACHED = re.compile(r"(?:^|/)(models|datasets)--([^/]+?)--([^/]+)(?:/|$)")


def is_prefpack_card(path: Path) -> bool:
    """Whether ``path`` is a card prefpack wrote (its marker line is there): written again, never kept as the user's."""
    try:
        return MARKER in path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


# ------------------------------------------------------------------------------------------------ what the card says


@dataclass
class Method:
    name: str  # "DPO (loss sigmoid)"
    tags: list[str]
    papers: list[tuple[str, str]]  # ('Authors year, "Title"', arxiv id or "")


@dataclass
class CardFacts:
    """Everything a card says, gathered once for ``final/`` and its ``adapter/``."""

    model_name: str
    kind: str  # policy | reward | vision
    method: Method
    base_model: str | None = None
    source: str | None = None  # model.name_or_path: what the run started from (an adapter's base)
    license: str | None = None
    datasets: list[str] = field(default_factory=list)
    settings: list[tuple[str, str]] = field(default_factory=list)
    eval_metrics: dict[str, Any] | None = None
    eval_step: int | None = None
    lora: bool = False
    chat: bool = False  # the training rows were chat messages (rendered by the tokenizer's chat template)
    has_template: bool = False  # the saved tokenizer carries a chat template
    text_call: str = ""  # the reward model's usage: the pipeline call that gives it the store's ids ("": none found)


def _run_config(run_dir: Path):
    """``config.yaml`` of the run ``run_dir`` belongs to (beside ``final/``, or above a round's folder); None when
    there is none or it does not load."""
    from prefpack.config import load_config

    for folder in (run_dir, *list(run_dir.parents)[:3]):
        path = folder / "config.yaml"
        if path.is_file():
            try:
                return load_config(path), folder
            except Exception as exc:  # a config a newer/older prefpack wrote: the card says less, the save goes on
                print(f"warning: model card: {path} does not load ({str(exc).splitlines()[0]}); the card leaves "
                      "out the run's settings", file=sys.stderr)
                return None, folder
    return None, run_dir


def _method(cfg, reward: bool) -> Method:
    from prefpack.losses import PAIR_LOSSES
    from prefpack.losses.pg import PG_LOSSES
    from prefpack.losses.unpaired import UNPAIRED_LOSSES
    from prefpack.objectives.names import train_objective

    row = train_objective(cfg) if cfg is not None else None
    if reward or (row is not None and row.sequence_classifier):
        return Method("Bradley-Terry reward model (pairwise logistic loss on scalar rewards, as TRL's RewardTrainer)",
                      ["reward-model", "reward-trainer"], [_BRADLEY_TERRY, _INSTRUCTGPT])
    if cfg is None:
        return Method("preference fine-tuning", [], [])
    names = [t.name for t in cfg.loss.terms]
    tags: list[str] = []
    papers: list[tuple[str, str]] = []
    for name in names:
        spec = PG_LOSSES.get(name) if row.loss_names is not None else None
        spec = spec or UNPAIRED_LOSSES.get(name) or PAIR_LOSSES.get(name)
        tag = _TAGS.get(name, name.replace("_", "-"))
        if tag not in tags:
            tags.append(tag)
        if spec is not None and spec.paper and (spec.paper, spec.arxiv) not in papers:
            papers.append((spec.paper, spec.arxiv))
    terms = " + ".join(f"{t.weight:g} x {t.name}" if t.weight != 1 else t.name for t in cfg.loss.terms)
    title = "group policy gradient (GRPO family) over scored samples" if row.loss_names is not None \
        else "KTO family, on unpaired examples" if any(n in UNPAIRED_LOSSES for n in names) \
        else "DPO family, on preference pairs"
    return Method(f"{title}; loss {terms}", tags, papers)


_TAGS = {"sigmoid": "dpo", "sigmoid_ref_free": "dpo", "sigmoid_norm": "dpo", "robust": "robust-dpo",
         "hinge": "slic", "apo_zero": "apo", "apo_down": "apo", "apo_zero_unpaired": "apo", "bco_pair": "bco",
         "bco_pair_running": "bco", "exo_pair": "exo", "nca_pair": "nca", "sppo_hard": "sppo", "aot_unpaired": "aot",
         "nll": "rpo", "dr_grpo": "dr-grpo"}


def _settings(cfg, reward: bool) -> list[tuple[str, str]]:
    from prefpack.loss_params import LOSS_PARAMS
    from prefpack.losses import PAIR_LOSSES
    from prefpack.losses.unpaired import UNPAIRED_LOSSES

    out = [("train.objective", cfg.train.objective)]
    if not reward:
        out.append(("loss.terms", ", ".join(f"{t.name} (weight {t.weight:g})" for t in cfg.loss.terms)))
        read: list[str] = []
        for t in cfg.loss.terms:
            spec = PAIR_LOSSES.get(t.name) or UNPAIRED_LOSSES.get(t.name)
            for p in (spec.params if spec is not None else ("beta",)):
                if p not in read and p in LOSS_PARAMS:
                    read.append(p)
        out += [(f"loss.{p}", _show(getattr(cfg.loss, p, None))) for p in read]
        out.append(("reference.mode", str(cfg.reference.mode)))
    elif getattr(cfg.loss, "center_rewards_coefficient", None):
        out.append(("loss.center_rewards_coefficient", _show(cfg.loss.center_rewards_coefficient)))
    out += [("optim.lr", _show(cfg.optim.lr)), ("optim.schedule", cfg.optim.schedule),
            ("optim.warmup_steps / warmup_ratio", f"{cfg.optim.warmup_steps} / {cfg.optim.warmup_ratio:g}"),
            ("train.global_batch_pairs", str(cfg.train.global_batch_pairs)),
            ("train.max_steps" if cfg.train.max_steps else "train.epochs",
             str(cfg.train.max_steps) if cfg.train.max_steps else f"{cfg.train.epochs:g}"),
            ("train.seed", str(cfg.train.seed))]
    if cfg.rounds.count:
        out.append(("rounds", f"{cfg.rounds.count} x {cfg.rounds.steps_per_round} steps, "
                              f"{cfg.rounds.samples_per_prompt} samples a prompt"))
    if cfg.lora.enabled:
        targets = cfg.lora.target_modules if isinstance(cfg.lora.target_modules, str) \
            else ", ".join(cfg.lora.target_modules)
        out.append(("lora", f"r {cfg.lora.r}, alpha {cfg.lora.alpha}, dropout {cfg.lora.dropout:g}, "
                            f"target_modules {targets}"))
    if cfg.model.quantization:
        out.append(("model.quantization", str(cfg.model.quantization)))
    return out


def _show(value) -> str:
    return "null" if value is None else f"{value:g}" if isinstance(value, float) else str(value)


def _front_matter(path: Path) -> dict:
    """The YAML header of a model card (``{}`` when it has none or it does not parse)."""
    import yaml

    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return {}
    if not text.startswith("---"):
        return {}
    end = text.find("\n---", 3)
    try:
        data = yaml.safe_load(text[3:end]) if end > 0 else None
    except yaml.YAMLError:
        return {}
    return data if isinstance(data, dict) else {}


def _cached_card(repo_id: str) -> Path | None:
    """A hub model's card as the local hub cache holds it (never fetched)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, CARD)
    except Exception:
        return None
    return Path(found) if isinstance(found, str) else None


def _base_model(name: str | None) -> tuple[str | None, str | None]:
    """(``base_model``, ``license``): a hub id as it is (its card from the local cache for the licence); a local
    folder by the hub id its path names (the hub cache's ``models--ORG--NAME``) or its own card's ``base_model``;
    otherwise none (a local folder is no hub model)."""
    if not name:
        return None, None
    path = Path(name)
    if path.exists():
        card = _front_matter(path / CARD) if path.is_dir() else {}
        cached = _CACHED.search(str(path.resolve()).replace("\\", "/"))
        base = f"{cached.group(2)}/{cached.group(3)}" if cached and cached.group(1) == "models" else None
        if base is None:
            own = card.get("base_model")
            base = own if isinstance(own, str) else own[0] if isinstance(own, list) and own else None
        return base, _license(card)
    if not _HUB_ID.match(name):
        return None, None
    cached_card = _cached_card(name)
    return name, _license(_front_matter(cached_card)) if cached_card else None


def _license(card: dict) -> str | None:
    value = card.get("license")
    return str(value) if isinstance(value, str | int) and str(value) else None


def _stores(cfg) -> list[Path]:
    from prefpack.config.schema import TrainSource

    train = cfg.data.train
    items = [] if train is None else [train] if isinstance(train, str) else list(train)
    paths = [Path(t.path if isinstance(t, TrainSource) else t) for t in items]
    prompts = cfg.rounds.prompts if cfg.rounds.count else None
    for p in [prompts] if isinstance(prompts, str) else prompts or []:
        if Path(p).is_dir():
            paths.append(Path(p))
    return paths


def _store_meta(path: Path) -> dict:
    try:
        return json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}


def _hub_datasets(metas: list[dict]) -> list[str]:
    """The hub datasets the stores were prepared from: a source file in the hub cache (``datasets--ORG--NAME``)."""
    out: list[str] = []
    for meta in metas:
        for src in meta.get("sources") or []:
            found = _CACHED.search(str(src.get("path", "")).replace("\\", "/"))
            if found and found.group(1) == "datasets":
                name = f"{found.group(2)}/{found.group(3)}"
                if name not in out:
                    out.append(name)
    return out


def _last_eval(run_dir: Path) -> tuple[int | None, dict | None]:
    from prefpack.metrics import METRICS_FILE, read_metrics

    path = run_dir / METRICS_FILE
    if not path.is_file():
        return None, None
    lines = [x for x in read_metrics(path) if x.get("split") == "eval"]
    if not lines:
        return None, None
    last = lines[-1]
    return int(last.get("step", 0)), {k: v for k, v in last.items() if k not in ("step", "split", "time", "round")}


PROBE_PROMPT, PROBE_COMPLETION = "Q: What is 2 + 2?\nA:", " 4"
PROBE_MESSAGES = ([{"role": "user", "content": "What is 2 + 2?"}], [{"role": "assistant", "content": "4"}])


def _scoring_call(tok, chat: bool) -> str | None:
    """The pipeline call that gives a reward model the token ids ``prepare`` lays out for a (prompt, completion): a
    probe example tokenised by the store's own code, against what the tokenizer makes of the text each candidate
    call hands it (with or without the EOS prepare appends, with or without the tokenizer's BOS). ``chat``: the text
    is the chat template's rendering (``text``), else ``prompt + completion``. None: no candidate gives the same ids
    (the card then says to check)."""
    from prefpack.data.formats import Example
    from prefpack.data.tokenize import ExampleTokenizer, TokenizeConfig
    from prefpack.tokenizer import special_tokens

    if tok is None or (chat and not getattr(tok, "chat_template", None)):
        return None
    try:
        if chat:
            ex = Example(PROBE_MESSAGES[0], (PROBE_MESSAGES[1],), chat=True, label=1, completion_fields=("completion",))
            text = tok.apply_chat_template(PROBE_MESSAGES[0] + PROBE_MESSAGES[1], tokenize=False)
        else:
            ex = Example(PROBE_PROMPT, (PROBE_COMPLETION,), chat=False, label=1, completion_fields=("completion",))
            text = PROBE_PROMPT + PROBE_COMPLETION
        out = ExampleTokenizer(tok, special_tokens(tok), TokenizeConfig())([ex])[0]
        want = list(out.prompt) + list(out.completions[0])
        base = "text" if chat else "prompt + completion"
        for eos in ("", " + tok.eos_token"):
            for bos in ("", "tok.bos_token + "):
                if bos and tok.bos_token is None:
                    continue
                for specials in (True, False):
                    full = (tok.bos_token if bos else "") + text + (tok.eos_token if eos else "")
                    if tok(full, add_special_tokens=specials)["input_ids"] == want:
                        return f"rm({bos}{base}{eos}{'' if specials else ', add_special_tokens=False'})"
    except Exception as exc:  # a tokenizer the probe cannot run: the card says to check
        print(f"warning: model card: the scoring probe failed ({type(exc).__name__}: {exc})", file=sys.stderr)
    return None


def card_facts(run_dir: Path, model, tok) -> CardFacts:
    """What the cards of ``run_dir/final`` say, from the run's config and metrics beside it, the stores it names and
    the saved model and tokenizer."""
    from prefpack.model import is_reward_model

    reward = is_reward_model(model)
    cfg, home = _run_config(run_dir)
    kind = "reward" if reward else "vision" if getattr(model.config, "vision_config", None) is not None else "policy"
    base = cfg.model.name_or_path if cfg is not None else getattr(model.config, "_name_or_path", None)
    base_model, licence = _base_model(base)
    metas = [_store_meta(p) for p in _stores(cfg)] if cfg is not None else []
    step, metrics = _last_eval(home)
    facts = CardFacts(model_name=home.name, kind=kind, method=_method(cfg, reward), base_model=base_model,
                      source=str(base) if base else None,
                      license=licence, datasets=_hub_datasets(metas),
                      settings=_settings(cfg, reward) if cfg is not None else [], eval_metrics=metrics,
                      eval_step=step, lora=bool(cfg is not None and cfg.lora.enabled),
                      chat=any((m.get("counts") or {}).get("chat_examples") for m in metas),
                      has_template=bool(tok is not None and getattr(tok, "chat_template", None)))
    if reward:
        facts.text_call = _scoring_call(tok, facts.chat and facts.has_template) or ""
    return facts


# ------------------------------------------------------------------------------------------------ the reward model's template


def reward_chat_template(tok, run_dir: Path) -> str | None:
    """A reward model's tokenizer given the chat template its chat rows were rendered with, when it has none of its
    own and that template can be found (``prepare --chat-template FILE`` recorded in the store, the file unchanged):
    RewardBench and transformers' pipelines format a conversation with the tokenizer's template. Returns a line
    saying what was done, or None."""
    from prefpack.tokenizer import template_sha

    if tok is None or getattr(tok, "chat_template", None):
        return None
    cfg, _ = _run_config(run_dir)
    if cfg is None:
        return None
    for store in _stores(cfg):
        meta = _store_meta(store)
        used = meta.get("chat_template") or {}
        given = (meta.get("args") or {}).get("chat_template")
        if not used or not given or not Path(given).is_file():
            continue
        text = Path(given).read_text(encoding="utf-8")
        if template_sha(text) == used.get("sha256"):
            tok.chat_template = text
            return f"the reward model's tokenizer carries the chat template its rows were rendered with ({given})"
    return None


# ------------------------------------------------------------------------------------------------ writing


def write_cards(folder: Path, facts: CardFacts, *, shown_path: str) -> None:
    """``folder/README.md`` (unless a card of the user's is there), and ``folder/adapter/README.md`` for LoRA."""
    target = folder / CARD
    if not target.exists() or is_prefpack_card(target):
        target.write_text(render(facts, shown_path=shown_path), encoding="utf-8")
    adapter = folder / "adapter"
    if adapter.is_dir():  # peft writes a placeholder card there: ours replaces it
        (adapter / CARD).write_text(render(facts, shown_path=f"{shown_path}/adapter", adapter=True), encoding="utf-8")


def render(facts: CardFacts, *, shown_path: str, adapter: bool = False) -> str:
    import yaml

    header: dict[str, Any] = {}
    if facts.base_model:
        header["base_model"] = facts.base_model
    if facts.datasets:
        header["datasets"] = list(facts.datasets)
    header["library_name"] = "peft" if adapter else "transformers"
    if facts.license:
        header["license"] = facts.license
    header["model_name"] = facts.model_name
    if facts.kind == "reward" and not adapter:
        header["pipeline_tag"] = "text-classification"
    tags = ["prefpack", *facts.method.tags]
    if facts.lora:
        tags += ["lora"] if adapter else ["lora", "merged"]
    header["tags"] = list(dict.fromkeys(tags))
    front = yaml.safe_dump(header, sort_keys=False, allow_unicode=True).strip()
    m = facts.method
    what = "LoRA adapter" if adapter else "reward model" if facts.kind == "reward" else "model"
    base = f"[{facts.base_model}](https://huggingface.co/{facts.base_model})" if facts.base_model else \
        f"`{facts.source}`" if facts.source else "its base model"
    if facts.base_model and facts.source and facts.source != facts.base_model:
        base += f" (through `{facts.source}`)"
    data = (" on " + ", ".join(f"[{d}](https://huggingface.co/datasets/{d})" for d in facts.datasets)) \
        if facts.datasets else ""
    lines = [f"---\n{front}\n---", MARKER, "", f"# Model card for {facts.model_name}", "",
             f"This {what} is a fine-tuned version of {base}{data}, trained with prefpack {_prefpack_version()}.", "", "## Quick start", "",
             *_usage(facts, shown_path, adapter), "", "## Training procedure", "",
             f"Method: {m.name}."]
    if m.papers:
        lines += ["", "Introduced in:", ""]
        lines += [f"- {p}" + (f" ([arXiv:{a}](https://huggingface.co/papers/{a}))" if a else "") for p, a in m.papers]
    if facts.settings:
        lines += ["", "Main settings (the whole config: `config.yaml` beside this folder):", "",
                  "| setting | value |", "|---|---|", *[f"| `{k}` | {v} |" for k, v in facts.settings]]
    if facts.lora and not adapter:
        lines += ["", "The LoRA adapters are merged into these weights; the adapter alone is in `adapter/`."]
    if facts.eval_metrics:
        lines += ["", f"### Last evaluation (step {facts.eval_step})", "", "| metric | value |", "|---|---|"]
        lines += [f"| {k} | {_metric(v)} |" for k, v in facts.eval_metrics.items()]
    lines += ["", "### Framework versions", "", *[f"- {n}: {v}" for n, v in _versions()], "", "## Citations", ""]
    cites = [_bibtex(p, a) for p, a in m.papers]
    lines += ["Cite the method as:", "", "```bibtex", "\n\n".join(cites), "```"] if cites else \
        ["No paper is recorded for this method."]
    return "\n".join(lines) + "\n"


def _metric(v) -> str:
    return "null" if v is None else f"{v:.6g}" if isinstance(v, float) else str(v)


def _prefpack_version() -> str:
    import prefpack

    return prefpack.__version__


def _versions() -> list[tuple[str, str]]:
    out = [("prefpack", _prefpack_version())]
    for name, dist in (("PyTorch", "torch"), ("Transformers", "transformers"), ("PEFT", "peft")):
        try:
            out.append((name, metadata.version(dist)))
        except metadata.PackageNotFoundError:
            pass
    return out


def _bibtex(paper: str, arxiv: str) -> str:
    found = _PAPER.match(paper)
    if found is None:
        return f"@misc{{{arxiv or 'paper'},\n  title = {{{paper}}}\n}}"
    authors, year, title = found.group("authors"), found.group("year"), found.group("title")
    first = re.sub(r"[^a-z]", "", authors.split()[0].lower().split(",")[0]) or "paper"
    key = f"{first}{year}{re.sub(r'[^a-z]', '', title.split()[0].lower())}"
    author = authors.replace(" et al.", " and others").replace(" & ", " and ").replace(", ", " and ")
    fields = [f"  title = {{{{{title}}}}}", f"  author = {{{author}}}", f"  year = {year}"]
    if arxiv:
        fields += [f"  eprint = {{{arxiv}}}", "  archivePrefix = {arXiv}"]
    return f"@misc{{{key},\n" + ",\n".join(fields) + "\n}"


def _usage(f: CardFacts, path: str, adapter: bool) -> list[str]:
    if adapter:
        auto = "AutoModelForSequenceClassification" if f.kind == "reward" else "AutoModelForCausalLM"
        base = f.source or f.base_model or "BASE_MODEL"  # the weights the adapter was trained on
        extra = ", num_labels=1" if f.kind == "reward" else ""
        return ["```python", "from peft import PeftModel", f"from transformers import {auto}", "",
                f'base = {auto}.from_pretrained("{base}"{extra})',
                f'model = PeftModel.from_pretrained(base, "{path}")', "```"]
    if f.kind == "reward":
        lines = ["```python", "from transformers import pipeline", "",
                 f'rm = pipeline("text-classification", model="{path}", function_to_apply="none")',
                 "tok = rm.tokenizer", ""]
        call = f.text_call or ("rm(text)" if f.chat and f.has_template else "rm(prompt + completion + tok.eos_token)")
        if f.chat and f.has_template:
            lines += [f"messages = {PROBE_MESSAGES[0] + PROBE_MESSAGES[1]!r}",
                      "text = tok.apply_chat_template(messages, tokenize=False)"]
            said = "the conversation rendered by the tokenizer's chat template, as the training rows were"
        else:
            lines += [f"prompt, completion = {PROBE_PROMPT!r}, {PROBE_COMPLETION!r}"]
            said = "the prompt and the completion as the training store laid them out"
        lines += [f'print({call}[0]["score"])', "```", ""]
        eos = " + tok.eos_token" in call
        lines += [f"The call gives the model {said}" + (" (with the EOS `prepare` appends to every completion: "
                  "without it the score is read one token early and differs)" if eos else "") + "."
                  if f.text_call else f"Check that the call gives the model {said} (`prepare` ends every "
                  "completion with EOS): this card could not confirm it for this tokenizer."]
        lines += ["The score is the raw reward (`function_to_apply=\"none\"`; the default applies a sigmoid). "
                  "`AutoModelForSequenceClassification` loads the folder too (`num_labels: 1`, a pad token)."]
        return lines
    if f.kind == "vision":
        return ["```python", "from transformers import AutoModelForImageTextToText, AutoProcessor", "",
                f'model = AutoModelForImageTextToText.from_pretrained("{path}")',
                f'processor = AutoProcessor.from_pretrained("{path}")', "```"]
    lines = ["```python", "from transformers import AutoModelForCausalLM, AutoTokenizer", "",
             f'model = AutoModelForCausalLM.from_pretrained("{path}")',
             f'tok = AutoTokenizer.from_pretrained("{path}")']
    if f.has_template:
        lines += ['messages = [{"role": "user", "content": "What is 2 + 2?"}]',
                  'inputs = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", '
                  'return_dict=True)']
    else:
        lines += ['inputs = tok("Q: What is 2 + 2?\\nA:", return_tensors="pt")']
    lines += ["out = model.generate(**inputs, max_new_tokens=64)",
              'print(tok.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True))', "```"]
    return lines
