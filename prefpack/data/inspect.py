"""`prefpack inspect`: a store's meta, length statistics, and one example decoded (unscored completion tokens shown
between ⟦ and ⟧, with counts of scored and total tokens; where a completion's next segment starts, a sequence of
its own after the prompt again, ``⟪new sequence: the prompt again⟫``; an image's run of image tokens shown as
``<|image_pad|> x N`` with the image's size). In a ranked store an example is its row's whole prompt group: the prompt once, every
completion ranked by score, and the pairs ``data.ranked_pairs`` draws from them, as a reader of a round's samples
wants to judge them."""

from __future__ import annotations

import json
from typing import Any

import numpy as np

from prefpack.data.spans import scored_of, segments_of
from prefpack.data.store import FLAG_COMPLETION_TRUNCATED, FLAG_PROMPT_TRUNCATED, Store, StoreError
from prefpack.data.store_format import grouping_pays
from prefpack.data.truncation import describe
from prefpack.data.views import group_pairs
from prefpack.vision_families import FAMILIES

UNSCORED_OPEN, UNSCORED_CLOSE = "⟦", "⟧"
SEGMENT_MARK = "⟪new sequence: the prompt again⟫"


def length_stats(store: Store) -> dict[str, Any]:
    parts = ("prompt", "chosen", "rejected") if store.kind == "pairs" else ("prompt", "completion")
    stats: dict[str, Any] = {"examples": len(store), "tokens": store.num_tokens}
    comp = ("chosen_len", "rejected_len") if store.kind == "pairs" else ("completion_len",)
    stats["completion_tokens"] = int(sum(int(store.column(c).sum()) for c in comp)) if len(store) else 0
    stats["unscored_tokens"] = int((store.spans[:, 1] - store.spans[:, 0]).sum()) if len(store.spans) else 0
    if store.num_segments:
        stats["segments"] = store.num_segments
    if store.num_images:
        stats["images"] = store.num_images
        stats["image_tokens"] = int(np.asarray(store.image_index[:, 6]).sum())
    for part in parts:
        col = store.column(f"{part}_len")
        stats[part] = _summary(col)
    if store.kind == "pairs":
        seq = store.column("prompt_len") * 2 + store.column("chosen_len") + store.column("rejected_len")
        stats["pair_tokens"] = _summary(seq)
    elif store.kind == "ranked":  # prompt lengths per prompt, not per completion row
        starts = store.group_starts()
        stats["prompt"] = _summary(store.column("prompt_len")[starts[:-1]])
        stats["prompts"] = len(starts) - 1
        stats["completions_per_prompt"] = _summary(np.diff(starts))
    else:
        labels = store.column("label")
        stats["desirable"] = int(labels.sum())
        stats["undesirable"] = int(len(labels) - labels.sum())
    return stats


def _summary(col: np.ndarray) -> dict[str, float]:
    if len(col) == 0:
        return {"mean": 0.0, "p50": 0, "p90": 0, "max": 0}
    return {
        "mean": round(float(col.mean()), 2),
        "p50": int(np.percentile(col, 50, method="nearest")),
        "p90": int(np.percentile(col, 90, method="nearest")),
        "max": int(col.max()),
    }


def decode_row(store: Store, i: int, tok, ranked_pairs: str = "best_vs_rest") -> dict[str, Any]:
    """Example ``i`` decoded; in a ranked store, row ``i``'s prompt group with the pairs ``ranked_pairs`` draws."""
    if not 0 <= i < len(store):
        raise StoreError(f"--row {i} is out of range: the store has {len(store)} examples (0..{len(store) - 1})")
    out: dict[str, Any] = {
        "index": i,
        "source": {"file": store.meta["sources"][int(store.column("source_file")[i])]["path"],
                   "row": int(store.column("source_row")[i])},
        "truncated": _truncated(store, i),
    }
    image = _image_token(store)
    if image is not None:
        out["images"] = [{k: v for k, v in info.items() if k != "data"} for info in store.prompt_images(i)]
    if store.kind == "ranked":
        out.update(_ranked_group(store, i, tok, image, ranked_pairs))
        return out
    if store.kind == "pairs":
        ex = store.pair(i)
        parts = {"prompt": ex.prompt, "chosen": ex.chosen, "rejected": ex.rejected}
    else:
        ex = store.unpaired(i)
        parts = {"prompt": ex.prompt, "completion": ex.completion}
        out["label"] = bool(ex.label)
    for name, ids in parts.items():
        out.update(_decoded_part(tok, name, ids, image))
    return out


def _truncated(store: Store, i: int) -> list[str]:
    flags = int(store.column("flags")[i])
    return [name for bit, name in ((FLAG_PROMPT_TRUNCATED, "prompt"), (FLAG_COMPLETION_TRUNCATED, "completion"))
            if flags & bit]


def _decoded_part(tok, name: str, ids, image: tuple[int, str] | None) -> dict[str, Any]:
    """``NAME_ids`` and ``NAME`` (the text), and where some tokens are unscored ``NAME_scored`` and ``NAME_marked``."""
    out: dict[str, Any] = {f"{name}_ids": [int(t) for t in ids]}
    out[name] = tok.decode(out[f"{name}_ids"], skip_special_tokens=False) if image is None else \
        abbreviated_text(tok, out[f"{name}_ids"], *image)
    scored, cuts = scored_of(ids), segments_of(ids)
    if scored is not None or cuts is not None:
        out[f"{name}_scored"] = [True] * len(ids) if scored is None else [bool(x) for x in scored]
        out[f"{name}_marked"] = marked_text(tok, out[f"{name}_ids"], out[f"{name}_scored"], cuts)
    if cuts is not None:
        out[f"{name}_segments"] = [int(k) for k in cuts]
    return out


def _ranked_group(store: Store, i: int, tok, image, mode: str) -> dict[str, Any]:
    """Row ``i``'s prompt group: the prompt, its completions best first (ties in store order, as training breaks
    them) and the (chosen, rejected) pairs ``mode`` draws, by store row."""
    starts = store.group_starts()
    g = int(np.searchsorted(starts, i, side="right")) - 1
    a, b = int(starts[g]), int(starts[g + 1])
    prompt, comps = store.ranked_group(g)
    scores = store.scores()[a:b]
    completions = []
    for k in sorted(range(b - a), key=lambda k: (-scores[k], k)):
        part = _decoded_part(tok, "completion", comps[k], image)
        scored = part.get("completion_scored")
        completions.append({"row": a + k, "score": float(scores[k]), "tokens": len(comps[k]),
                            "scored_tokens": len(comps[k]) if scored is None else sum(scored),
                            "truncated": "completion" in _truncated(store, a + k),
                            "ids": part["completion_ids"], "text": part["completion"],
                            **({"scored": scored, "marked": part["completion_marked"]} if scored else {}),
                            **({"segments": part["completion_segments"]} if "completion_segments" in part else {})})
    pairs = [{"chosen": a + c, "rejected": a + r, "gap": float(scores[c] - scores[r])}
             for c, r in group_pairs(scores, mode)]
    return {"group": g, "rows": [a, b], "score": float(store.scores()[i]),
            **_decoded_part(tok, "prompt", prompt, image), "completions": completions,
            "pairs": {"mode": mode, "pairs": pairs}}


def _image_token(store: Store) -> tuple[int, str] | None:
    """The image token's id and text of a store with images."""
    proc = store.meta.get("processor") or {}
    return (int(proc["image_token_id"]), str(proc["image_token"])) if store.num_images and proc else None


def _runs(ids: list[int], tid: int) -> list[tuple[bool, int, int]]:
    """(is an image run, start, end) over ids."""
    out, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or (ids[k] == tid) != (ids[start] == tid):
            out.append((ids[start] == tid, start, k))
            start = k
    return out


def abbreviated_text(tok, ids: list[int], tid: int, token: str) -> str:
    """The decoded text with each run of image tokens written as ``<|image_pad|> x N``."""
    return "".join(f"{token} x {b - a}" if image else tok.decode(ids[a:b], skip_special_tokens=False)
                   for image, a, b in _runs(ids, tid))


def abbreviated_ids(ids: list[int], tid: int) -> str:
    """The ids as a list, each run of image tokens written as ``ID x N``."""
    return "[" + ", ".join(f"{tid} x {b - a}" if image else ", ".join(map(str, ids[a:b]))
                           for image, a, b in _runs(ids, tid)) + "]"


def marked_text(tok, ids: list[int], scored: list[bool], segments=None) -> str:
    """The decoded completion with each run of unscored tokens between ⟦ and ⟧, and ``SEGMENT_MARK`` where a
    segment starts (``segments``: its offsets)."""
    cuts = {int(k) for k in segments} if segments is not None else set()
    parts, start = [], 0
    for k in range(1, len(ids) + 1):
        if k == len(ids) or scored[k] != scored[start] or k in cuts:
            text = tok.decode(ids[start:k], skip_special_tokens=False)
            parts.append(text if scored[start] else UNSCORED_OPEN + text + UNSCORED_CLOSE)
            if k in cuts:
                parts.append(f"\n{SEGMENT_MARK}\n")
            start = k
    return "".join(parts)


def _num(x) -> str:
    return "-" if x is None else f"{x:.4g}"


def format_text(store: Store, stats: dict, row: dict | None) -> str:
    m = store.meta
    lines = [
        f"store      {store.path}",
        f"layout     {m['layout']} ({store.kind}), format v{m['format_version']}, dtype {m['dtype']}",
        f"tokenizer  {m['tokenizer']['name']} (vocab {m['tokenizer']['vocab_size']}, "
        f"hash {m['tokenizer']['hash'][:12]})",
        f"examples   {stats['examples']} from {m['counts']['rows_read']} rows; {stats['tokens']} tokens",
    ]
    if m.get("chat_template"):  # stores from before version 3 of the tokenizer hash record none
        t = m["chat_template"]
        marks = ", {% generation %} masks" if t.get("generation_markers") else ""
        lines.insert(3, f"template   {t.get('name', '?')} (sha256 {t['sha256'][:12]}, {t.get('chars', '?')} "
                        f"characters{marks})")
        if isinstance(m.get("renderer"), dict):  # stores prepared before it was recorded have none
            lines.insert(4, "renderer   " + ", ".join(f"{k} {v}" for k, v in m["renderer"].items()))
    if stats.get("segments"):
        lines.append(f"segments   {stats['segments']} later segments of completions start a sequence of their own "
                     "(the prompt again, then the segment: segments.bin)")
    if m.get("train_on") or stats["unscored_tokens"]:
        lines.append(f"scoring    train_on={m.get('train_on') or '-'}; {m.get('num_spans', 0)} unscored spans: "
                     f"{stats['completion_tokens'] - stats['unscored_tokens']} of {stats['completion_tokens']} "
                     "completion tokens scored")
    if m.get("scoring"):  # written by prefpack score
        sc = m["scoring"]
        by = sc.get("model") or f"{sc.get('file')}:{sc.get('function')}"
        lines.append(f"scores     by {sc.get('scorer')} {by}: {sc.get('completions')} completions, min "
                     f"{_num(sc.get('min'))}, mean {_num(sc.get('mean'))}, max {_num(sc.get('max'))}")
    if store.margins is not None:  # a pair store's margins.bin (version 4): a reward model's loss reads them
        mg = np.asarray(store.margins)
        lines.append(f"margins    {m.get('num_margins')} of {len(store)} pairs give one (the others 0): min "
                     f"{_num(float(mg.min()))}, mean {_num(float(mg.mean()))}, max {_num(float(mg.max()))}")
    if stats.get("images"):
        proc = m.get("processor") or {}
        family = FAMILIES.get(proc.get("kind"))  # older stores: none (Qwen2-VL's, shown as the class alone)
        lines.append(f"images     {stats['images']} ({stats['image_tokens']} image tokens), processor "
                     f"{proc.get('class')}{family.shown_as if family else ''} (hash {str(proc.get('hash'))[:12]}); "
                     "docs/images.md")
    if m.get("unused_columns"):
        lines.append("not used   input columns " + ", ".join(map(repr, m["unused_columns"])))
    c = m["counts"]
    for key in ("skipped", "dropped", "truncated"):
        if c.get(key):
            lines.append(f"{key:<10} " + ", ".join(f"{k}={v}" for k, v in sorted(c[key].items())))
    cut = describe(c.get("truncation") or {}, m.get("args", {}).get("max_length"),
                   (c.get("truncated") or {}).get("cut_before_tokenising", 0))
    if cut:  # stores from before the cut counts have none
        lines.append(f"{'':<10} {cut}")
    kept = {k: c[k] for k in ("empty_completions", "chat_examples", "examples_with_tools",
                               "examples_with_documents", "null_keys_dropped", "rows_split_by_turns",
                               "unread_template_kwargs") if c.get(k)}
    if (c.get("repeated_prompts") or {}).get("prompts"):  # pairs sharing a prompt with other pairs
        kept["repeated_prompts"] = c["repeated_prompts"]
    if kept:  # counted, not skipped: what prepare kept that a reader may want to know about
        shown = [f"{k}=" + (" ".join(f"{p}:{n}" for p, n in sorted(v.items())) if isinstance(v, dict) else str(v))
                 for k, v in kept.items()]
        lines.append("counted    " + ", ".join(shown))
    if "repeated_prompts" in kept and grouping_pays(kept["repeated_prompts"].get("pairs", 0), stats["examples"]):
        lines.append("           (pairs that repeat a prompt: data.group_by_prompt=true computes each prompt, and each "
                     "completion repeated in its pairs, once)")
    lines.append("")
    lines.append(f"{'lengths':<12}{'mean':>9}{'p50':>7}{'p90':>7}{'max':>7}")
    if "prompts" in stats:
        lines.append(f"{'prompts':<12}{stats['prompts']:>9} (completions per prompt: mean "
                     f"{stats['completions_per_prompt']['mean']:.1f}, max {stats['completions_per_prompt']['max']})")
    for part in ("prompt", "chosen", "rejected", "completion", "pair_tokens"):
        if part in stats:
            s = stats[part]
            lines.append(f"{part:<12}{s['mean']:>9.1f}{s['p50']:>7}{s['p90']:>7}{s['max']:>7}")
    if "desirable" in stats:
        lines.append(f"labels      desirable={stats['desirable']} undesirable={stats['undesirable']}")
    if row is not None:
        lines.append("")
        lines.extend(_row_lines(row, m))
    return "\n".join(lines)


def _row_lines(row: dict, m: dict) -> list[str]:
    """``--row``'s section: the example's parts (a ranked row: its prompt group) with ids, text and scored marks."""
    lines = [f"row {row['index']} (from {row['source']['file']} row {row['source']['row']})"
             + (f", truncated: {', '.join(row['truncated'])}" if row["truncated"] else "")]
    if "completions" in row:
        a, b = row["rows"]
        lines[0] += (f": prompt group {row['group']}, store rows {a}..{b - 1}, its {b - a} completions ranked by "
                     "score")
    for name in ("prompt", "chosen", "rejected", "completion"):
        if name in row and name + "_scored" in row:
            n, k = len(row[name + "_ids"]), sum(row[name + "_scored"])
            cut = row.get(name + "_segments")
            seq = f"; {len(cut) + 1} sequences, each after the prompt, from tokens {[0, *cut]}" if cut else ""
            lines.append(f"--- {name} ({n} tokens, {k} scored; unscored text between {UNSCORED_OPEN} and "
                         f"{UNSCORED_CLOSE}{seq}) ids={row[name + '_ids']}")
            lines.append(row[name + "_marked"])
        elif name in row:
            ids = row[name + "_ids"] if "images" not in row else \
                abbreviated_ids(row[name + "_ids"], int(m["processor"]["image_token_id"]))
            lines.append(f"--- {name} ({len(row[name + '_ids'])} tokens"
                         + (", all scored" if name != "prompt" else "") + f") ids={ids}")
            lines.append(row[name])
            if name == "prompt":
                for k, im in enumerate(row.get("images", [])):
                    lines.append(f"--- image {k}: {im['width']}x{im['height']} pixels, {im['bytes']} bytes, "
                                 f"{im['tokens']} image tokens from position {im['position']} in tokens.bin")
    if "completions" in row:
        lines.extend(_group_lines(row))
    if "label" in row:
        lines.append(f"--- label: {'desirable' if row['label'] else 'undesirable'}")
    return lines


def _group_lines(row: dict) -> list[str]:
    """A ranked group's completions, best first, and the pairs training draws from them."""
    lines = []
    for rank, c in enumerate(row["completions"], 1):
        asked = " (the row asked)" if c["row"] == row["index"] else ""
        scored = f"{c['scored_tokens']} scored; unscored text between {UNSCORED_OPEN} and {UNSCORED_CLOSE}" \
            if "scored" in c else "all scored"
        if c.get("segments"):
            scored += f"; {len(c['segments']) + 1} sequences, each after the prompt, from tokens {[0, *c['segments']]}"
        lines.append(f"--- #{rank} row {c['row']}{asked}: score {c['score']:g}, {c['tokens']} tokens, {scored}"
                     + (", truncated" if c["truncated"] else "") + f" ids={c['ids']}")
        lines.append(c.get("marked", c["text"]))
    pairs, mode = row["pairs"]["pairs"], row["pairs"]["mode"]
    if pairs:
        lines.append(f"--- pairs data.ranked_pairs={mode} draws ({len(pairs)}, chosen > rejected by store row): "
                     + ", ".join(f"{p['chosen']} > {p['rejected']} (gap {p['gap']:g})" for p in pairs))
    else:
        lines.append(f"--- pairs data.ranked_pairs={mode} draws: none (all {len(row['completions'])} scores tie; "
                     "training leaves this prompt out)")
    return lines


def inspect_store(path: str, *, row: int | None = None, as_json: bool = False, tokenizer: str | None = None,
                  verify: bool = False, trust_remote_code: bool = False, ranked_pairs: str = "best_vs_rest") -> str:
    """The store shown as text or one JSON object; ``ranked_pairs``: the pairing a ranked row's group is shown under
    (``data.ranked_pairs`` resolved)."""
    store = Store(path, verify=verify)
    if not verify:
        store.check_token_ids()  # cheap; --verify already did it with the hashes
    stats = length_stats(store)
    decoded = None
    if row is not None:
        from prefpack.tokenizer import load_tokenizer

        decoded = decode_row(store, row, load_tokenizer(tokenizer or store.tokenizer_path(),
                                                        trust_remote_code=trust_remote_code), ranked_pairs)
    if as_json:
        obj: dict[str, Any] = {"meta": store.meta, "stats": stats}
        if decoded is not None:
            obj["row"] = decoded
        return json.dumps(obj, ensure_ascii=False)
    return format_text(store, stats, decoded)
