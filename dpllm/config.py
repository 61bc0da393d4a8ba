"""Typed run configuration: model / data / train / privacy.

Parsed by ``transformers.HfArgumentParser`` from ``--config file.yaml`` plus ``--key value`` overrides.
The YAML holds four sections named like the dataclasses below (``model``, ``data``, ``train``,
``privacy``); a flat YAML (keys at the top level) also works. Unknown keys are errors, in the YAML and
on the command line. ``--help`` prints every option with its help text (defaults from the YAML, if any).

Example:
    >>> cfg = parse_config(["--max_steps", "3", "--finetuning", "full"])
    >>> cfg.train.max_steps, cfg.model.finetuning, cfg.privacy.accountant
    (3, 'full', 'prv')
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

from dpllm.io import dump_yaml, load_yaml


class ConfigError(ValueError):
    """A configuration value that cannot work, with a message that says what to change."""


def _f(default: Any, help: str, **kw: Any) -> Any:
    return field(default=default, metadata={"help": help, **kw})


@dataclass
class ModelConfig:
    model_name_or_path: str = _f(
        "tiny-llama",
        "Hub id, local directory, or run directory of an earlier stage; or 'tiny-llama' / 'tiny-gpt2' "
        "to build a tiny model from a config (CPU runs, tests).",
    )
    finetuning: str = _f("lora", "'lora' (peft adapters; base frozen) or 'full' (all parameters).")
    lora_r: int = _f(8, "LoRA rank.")
    lora_alpha: float = _f(16.0, "LoRA scaling alpha.")
    lora_dropout: float = _f(0.0, "LoRA dropout.")
    lora_target_modules: str = _f(
        "all-linear", "Comma-separated module names for LoRA, or 'all-linear' (every linear layer but the head)."
    )
    torch_dtype: str = _f("float32", "Weights dtype when loading: float32, bfloat16 or auto.")
    quantization: str = _f("none", "Load the frozen base quantized by bitsandbytes (QLoRA; finetuning: lora only; "
                                   "needs pip install 'dpllm[qlora]'): 'nf4' (4-bit NormalFloat, double-quantized, "
                                   "the QLoRA default), 'fp4', 'int8', or 'none'. The adapters train in torch_dtype "
                                   "(float32 by default) under DP as usual; only trainable parameters are clipped.")
    trust_remote_code: bool = _f(False, "Passed to from_pretrained.")
    random_init: bool = _f(False, "BENCHMARKS ONLY: build the model from model_name_or_path's config.json with random "
                                  "weights (on the GPU where there is one), reading no weights: to check that a config "
                                  "fits in memory and time its steps before downloading the model "
                                  "(scripts/gpu_proof.py). What it trains is no model of anything.")
    tiny_hidden_size: int = _f(64, "Hidden size of the tiny model built from a config.")
    tiny_num_layers: int = _f(2, "Layers of the tiny model.")
    tiny_num_heads: int = _f(4, "Attention heads of the tiny model.")
    tiny_intermediate_size: int = _f(256, "MLP width of the tiny model.")
    tiny_max_positions: int = _f(256, "Context length of the tiny model.")


@dataclass
class DataConfig:
    dataset: str = _f(
        "pydoc",
        "'pydoc' (Python's own documentation text, shipped with CPython), 'pystdlib' (CPython's standard-library "
        "source outside its tests, chunked by lines), 'stdlib_qa' (chat records: a stdlib function's signature → "
        "its docstring, dpllm.sft), a Hub dataset id, a datasets.save_to_disk folder, or a local "
        ".jsonl/.json/.csv/.parquet/.txt file (txt: one record per blank-line separated paragraph).",
    )
    dataset_config_name: Optional[str] = _f(None, "Hub dataset configuration name.")
    dataset_split: str = _f("train", "Hub dataset split to read.")
    text_column: str = _f("text", "Column holding the text of a record.")
    max_length: int = _f(128, "Tokens per record (longer records are truncated, or split: long_records); with "
                              "packing, tokens per packed row.")
    long_records: str = _f("truncate", "A record longer than max_length: 'truncate' (train on its first max_length "
                                       "tokens) or 'split' (cut it into consecutive windows of max_length tokens, "
                                       "all trained; the record stays the privacy unit: its windows are sampled "
                                       "together and their summed gradient is clipped once; the ε is the record "
                                       "level's). Text records, privacy_unit=record (DPTrainer: PrivacyArguments "
                                       "long_records).")
    max_windows: int = _f(8, "long_records=split: train on at most this many windows of a record, its first ones "
                             "(the cap bounds a step's cost; what it drops is reported). ≤ physical_batch_size: a "
                             "record's windows go through one backward pass.")
    window_stride: int = _f(0, "long_records=split: tokens each window after a record's first repeats from the end "
                               "of the window before (the overlap Hugging Face tokenizers call stride), as context "
                               "only: their labels are -100, so every token's loss counts once and each has context. "
                               "0 ≤ window_stride < max_length; the window cap and the ε are unchanged.")
    packing: bool = _f(False, "Pack several whole records into each row of max_length tokens (per step, from the "
                              "records sampled; no record cut across rows; with long_records=split the windows "
                              "are packed). Attention never crosses a record, and each record is still clipped "
                              "alone (bk), so the ε is the record level's; the speed-up is the padding not "
                              "computed. Text or chat records (SFT: the loss stays on each record's answer), "
                              "privacy_unit=record, one process, grad_sample_mode bk or auto.")
    min_chars: int = _f(32, "Records shorter than this many characters (after stripping) are dropped.")
    max_records: Optional[int] = _f(None, "Use at most this many records (after filtering and dedup): the ones "
                                          "whose keyed hash under split_seed ranks first, whatever their place "
                                          "in the file.")
    record_fraction: Optional[float] = _f(None, "Keep each record iff the keyed hash of its own text under split_seed "
                                                "is below this fraction (about fraction·N records): one record more "
                                                "or less in the file never moves another, so it is the way to use "
                                                "part of a private file under DP (max_records is refused there).")
    deduplicate: bool = _f(True, "Keep one copy of texts that repeat exactly (record-level: a copy would train as "
                                 "a second record; user-level: within each user, so a text two users wrote is a "
                                 "record of each). false keeps every copy (privacy_unit=record only).")
    public_dataset: Optional[str] = _f(None, "A second dataset (same forms as dataset) whose records you declare "
                                             "public: they form the public split, trained on without DP "
                                             "(train_on: public); a private record equal to one of them is "
                                             "treated as public too.")
    public_fraction: float = _f(
        0.0, "STUDIES ONLY: a random fraction of the PRIVATE file treated as public and trained on without DP. "
             "Refused unless simulate_public_from_private is true; real public data goes in public_dataset."
    )
    simulate_public_from_private: bool = _f(False, "Allow public_fraction: declare that this run only simulates "
                                                   "public data with records of the private file (a study).")
    heldout_fraction: float = _f(0.2, "Fraction of the private records held out (eval; audit non-members).")
    split_seed: int = _f(0, "Public key of the split: a record's split (held out or trained) is a keyed hash of "
                            "its own text under this key (at user level, of its user's id), so adding or removing "
                            "one record of the file moves no other record.")
    train_on: str = _f("private", "'private' (the train split; the DP unit) or 'public' (the public split).")
    num_canaries: int = _f(0, "Random canary records, each trained on with probability 1/2 (audit).")
    canary_seed: int = _f(1234, "Seed for canary secrets and their inclusion.")
    canary_design: str = _f("random", "Canary design (dpllm.canaries): 'random' (secret-sharer text); 'rare', "
                                      "'rare_long' or 'short' (secrets of characters the data never uses; easier "
                                      "to audit); 'new_token' (one new vocabulary token per canary; the strongest; "
                                      "full fine-tuning only).")
    privacy_unit: str = _f("record", "'record' (one record is protected) or 'user' (all records of one person are "
                                     "protected: data.user_column groups records; docs/user_level.md). 'sequence' (one "
                                     "packed block of max_length tokens) is declared through DPTrainer only.")
    user_column: str = _f("user", "Column naming each record's user (privacy_unit=user; JSONL/JSON/CSV/Hub). The "
                                  "built-in corpora have their own grouping (pydoc: topic chunks; pystdlib: file).")
    label_column: Optional[str] = _f(None, "Column holding each record's class label (JSONL/JSON/CSV/Hub). Opt-in: "
                                           "the label is prefixed to the text as a control code '[label] ' (Yue et "
                                           "al. 2023), so `dpllm synthesize` can ask for a class. Needs label_values.")
    earlier_stages_disjoint: bool = _f(False, "Declare that earlier private stages of the starting model trained on "
                                              "records disjoint from this stage's: their ε is then not composed "
                                              "(checked by content; an overlap is refused). Without it they are "
                                              "composed, whatever the data (a decision by overlap would leak).")
    label_values: Optional[str] = _f(None, "With label_column: the comma-separated classes, declared public (the card "
                                           "of a synthetic set lists them). Declared, never read from the data: a "
                                           "class only one record has would otherwise reveal that record; a record "
                                           "whose label is not listed is refused.")
    canary_records_per_user: int = _f(1, "privacy_unit=user: each canary is a user who writes its canary text in "
                                         "this many records (all in or all out by one coin); ≤ max_records_per_user.")
    max_records_per_user: Optional[int] = _f(None, "k: keep at most this many records of each user (chosen at random "
                                                   "with secret randomness); the k of ELS and record group privacy, "
                                                   "so required by user_sampling: els. None keeps all records "
                                                   "(record: user-level ε unbounded).")
    # instruction / chat fine-tuning (dpllm.sft)
    data_format: str = _f("auto", "Record shape: 'messages' (a list of {role, content}), 'prompt_completion' "
                                  "(prompt and completion columns), 'text', or 'auto' (detected from the columns).")
    loss_on: str = _f("answer", "messages / prompt_completion: 'answer' (assistant turns or the completion; prompt "
                                "tokens never enter the loss) or 'all' (the whole record). Held-out loss is the "
                                "answer's either way.")
    chat_template: Optional[str] = _f(None, "Jinja chat template (text or a file) rendering messages, or 'simple' "
                                            "(dpllm's built-in one); default: the tokenizer's own.")
    num_generations: int = _f(4, "messages / prompt_completion: greedy answers to this many held-out prompts, saved "
                                 "to OUTPUT_DIR/generations.jsonl at the end (private: never printed; 0: none).")


@dataclass
class TrainConfig:
    output_dir: str = _f("runs/default", "Run directory (config, splits, metrics, checkpoint, report).")
    overwrite_output_dir: bool = _f(False, "Replace an existing run directory.")
    max_steps: Optional[int] = _f(100, "Optimizer (logical-batch) steps. Ignored when epochs is set, except that "
                                   "--max_steps on the command line replaces a config file's epochs.")
    epochs: Optional[float] = _f(None, "Train for this many epochs: steps = ceil(epochs / sample_rate).")
    logical_batch_size: int = _f(64, "Expected records per optimizer step (Poisson sampling under DP).")
    physical_batch_size: int = _f(16, "Records per forward/backward pass (virtual batching).")
    optimizer: str = _f("adamw", "'adamw' or 'sgd'.")
    learning_rate: float = _f(1e-3, "Peak learning rate.")
    weight_decay: float = _f(0.0, "Weight decay.")
    momentum: float = _f(0.0, "SGD momentum.")
    lr_scheduler: str = _f("constant", "'constant', 'linear' or 'cosine' (transformers.get_scheduler).")
    warmup_steps: int = _f(0, "Linear warm-up steps.")
    eval_every: int = _f(50, "Evaluate held-out loss and perplexity every N steps (and at the end).")
    eval_max_records: Optional[int] = _f(256, "Held-out records used per evaluation (None: all).")
    log_every: int = _f(10, "Write a train metrics line every N steps.")
    seed: int = _f(0, "Seed for model init, the data split's shuffles and non-private batches. DP noise and "
                      "Poisson sampling never use it (fresh OS entropy), unless privacy.reproducible_noise.")
    mixed_precision: str = _f("no", "'no' or 'bf16' (autocast on GPU; CPU falls back to fp32).")
    gradient_checkpointing: bool = _f(False, "Recompute activations in backward; under DP only with "
                                             "grad_sample_mode bk (or auto resolving to bk), which clips once per "
                                             "record over the recomputation; see docs/operations.md.")
    save_every: Optional[int] = _f(None, "Write a resumable checkpoint every N steps and at the end, under "
                                         "OUTPUT_DIR/checkpoints/ (the last 2 are kept).")
    save_every_minutes: Optional[float] = _f(30.0, "Also write a resumable checkpoint when this many minutes have "
                                                   "passed since the last one, so a preempted job loses at most "
                                                   "that much (0 turns it off). SIGTERM and Ctrl-C also save one.")
    resume_from: Optional[str] = _f(None, "'latest' (OUTPUT_DIR/checkpoints/latest; a new run if OUTPUT_DIR does "
                                          "not exist) or a checkpoint directory of this run; the config must match.")
    runs_file: Optional[str] = _f(None, "Append this run's summary line to a runs table (JSONL).")
    progress: bool = _f(True, "Show a tqdm progress bar.")


@dataclass
class PrivacyConfig:
    enabled: bool = _f(True, "Train with DP-SGD. false trains the same loop without DP (baseline).")
    target_epsilon: Optional[float] = _f(8.0, "Calibrate the noise multiplier to reach this ε.")
    target_delta: float = _f(1e-5, "δ; must be < 1/N for N private records.")
    noise_multiplier: Optional[float] = _f(None, "Use this noise multiplier instead of calibrating.")
    max_grad_norm: float = _f(1.0, "Per-sample clipping norm C.")
    accountant: str = _f("prv", "'prv' (default), 'rdp' or 'gdp' (Opacus accountants), or 'pld' (dp-accounting's; "
                                 "PRV falls back to it where PRV cannot run, e.g. δ = 1e-10).")
    grad_sample_mode: str = _f("auto", "'auto' (default: bk where every trainable layer has a rule, also under "
                                       "FSDP, else Opacus hooks, or ghost where hooks' per-sample gradients would "
                                       "not fit; dpllm.privacy.modes), 'bk' (book-keeping: one backward pass), "
                                       "'hooks', 'ghost' (Opacus ghost clipping), 'ghost_fsdp' (Opacus, FSDP only).")
    clipping: str = _f("flat", "Per-sample clipping function (dpllm.privacy.clipping registry).")
    clipping_r: float = _f(0.1, "r of the psac/psasc clipping functions (stability constant of automatic).")
    clipping_s: float = _f(1.0, "s of psasc (sensitivity C/s).")
    target_quantile: float = _f(0.5, "clipping: quantile: the quantile γ of the per-record gradient norms that C "
                                     "tracks (C starts at max_grad_norm; dpllm.privacy.quantile).")
    quantile_lr: float = _f(0.2, "clipping: quantile: the learning rate η of C ← C·exp(−η(b̃ − γ)) (0 keeps C fixed).")
    count_noise_multiplier: Optional[float] = _f(None, "clipping: quantile: the noise σ_b of the count of records "
                                                       "under C (None: expected batch / 20); the gradient's noise "
                                                       "rises so that both together spend the planned σ.")
    secure_mode: bool = _f(False, "Noise from Opacus's cryptographically secure generator (needs torchcsprng; "
                                  "slower noise draws). Without it noise is still secretly seeded from OS entropy.")
    user_sampling: str = _f("uls", "With data.privacy_unit=user: 'uls' (Poisson-sample users; each sampled user adds "
                                   "one clipped gradient, the mean over its records; bk or hooks) or 'els' (sample "
                                   "records of the k-capped data; σ calibrated so the user-level ε by tight group "
                                   "privacy meets target_epsilon) or 'record' (record-level DP at target_epsilon, "
                                   "splits by user; the report adds the user-level ε tight group privacy gives, often "
                                   "huge).")
    noise_schedule: str = _f("constant", "σ over training (dpllm.privacy.schedule): 'constant', or 'linear' / "
                                         "'exponential' from σ₀ to σ₀·noise_schedule_end in noise_schedule_pieces "
                                         "constant pieces; σ₀ is calibrated so the whole schedule meets "
                                         "target_epsilon.")
    noise_schedule_end: float = _f(0.5, "σ of the schedule's last piece / σ of its first (< 1: decaying noise).")
    noise_schedule_pieces: int = _f(10, "Constant pieces of a linear or exponential schedule (2–4: step decay).")
    noise: str = _f("independent", "How the noise is made (dpllm.privacy.correlated): 'independent' (DP-SGD), "
                                   "'banded' (BandMF: noise correlated over `bands` steps, records (ULS: users) "
                                   "sampled in bands cyclic groups; bk, hooks or ghost; constant σ, fixed clip norm; "
                                   "keeps bands−1 noise tensors of the trainable parameters' size per process; "
                                   "docs/privacy.md) or 'blt' (buffered linear Toeplitz: `buffers` noise tensors per "
                                   "process, `bands` cyclic groups, the run accounted as one Gaussian mechanism "
                                   "without amplification; the same engines and units as banded).")
    bands: str = _f("auto", "noise: banded: the number of bands b (≤ ⌈N/B⌉), or 'auto' (the b of 1, 2, 4, ..., 32 "
                            "with the least expected error at target_epsilon; dpllm plan shows the comparison). "
                            "noise: blt: the number of cyclic groups b (BLT's min-separation, ≤ ⌈N/B⌉), or 'auto' "
                            "(the b of ⌈N/B⌉, ⌈N/B⌉/2, /4, /8 with the least expected error).")
    buffers: str = _f("auto", "noise: blt: the BLT buffers d (1–8; each keeps one noise tensor of the trainable "
                              "parameters' size per process), or 'auto' (the fewest after which one more lowers the "
                              "error by less than a hundredth, at most 5).")
    reproducible_noise: bool = _f(False, "Derive noise and Poisson sampling from train.seed (tests and debugging "
                                         "ONLY): anyone with the config can regenerate them, so the run is marked "
                                         "noise_secret=false and is not releasable.")


SECTIONS = {"model": ModelConfig, "data": DataConfig, "train": TrainConfig, "privacy": PrivacyConfig}


@dataclass
class RunConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    privacy: PrivacyConfig = field(default_factory=PrivacyConfig)

    def to_dict(self) -> dict:
        return {name: asdict(getattr(self, name)) for name in SECTIONS}

    def to_yaml(self) -> str:
        return dump_yaml(self.to_dict())


def _field_owner() -> dict[str, str]:
    owner: dict[str, str] = {}
    for section, cls in SECTIONS.items():
        for f in dataclasses.fields(cls):
            assert f.name not in owner, f"duplicate option name {f.name}"
            owner[f.name] = section
    return owner


def did_you_mean(name: str, known, *, prefix: str = "") -> str:
    """``"; did you mean PREFIXclose?"`` for the known name closest to a mistyped ``name`` (difflib), else ``""``."""
    import difflib

    close = difflib.get_close_matches(name, list(known), n=1, cutoff=0.6)
    return f"; did you mean {prefix}{close[0]}?" if close else ""


_BOOL_WORDS = ("true", "false", "yes", "no", "t", "f", "y", "n", "1", "0")  # HfArgumentParser's string_to_bool


def _type_problem(value: Any, hint: Any) -> Optional[str]:
    """Why a YAML value cannot be the option's type (the parser would refuse it naming the command-line flag,
    after 60 lines of usage), or None."""
    import typing

    args = typing.get_args(hint)
    optional = type(None) in args
    kind = next((a for a in args if a is not type(None)), hint) if args else hint
    if value is None:
        return None if optional else f"expected {kind.__name__}, got null"
    ok = {bool: lambda v: isinstance(v, bool) or (isinstance(v, str) and v.lower() in _BOOL_WORDS),
          int: lambda v: (isinstance(v, int) and not isinstance(v, bool)) or (isinstance(v, float) and v.is_integer())
          or (isinstance(v, str) and _parses(int, v)),
          float: lambda v: (isinstance(v, (int, float)) and not isinstance(v, bool))
          or (isinstance(v, str) and _parses(float, v)),
          str: lambda v: isinstance(v, (str, int, float)) and not isinstance(v, bool)}.get(kind)
    if ok is None or ok(value):
        return None
    return f"expected {kind.__name__}, got {value!r}"


def _parses(kind: type, text: str) -> bool:
    try:
        kind(text)
    except ValueError:
        return False
    return True


@functools.lru_cache(maxsize=None)
def _section_hints(section: str) -> dict[str, Any]:
    """The option types of one section, read once per process: ``typing.get_type_hints`` evaluates every string
    annotation again at each call (0.5 ms a section), and a config is checked option by option."""
    import typing

    return typing.get_type_hints(SECTIONS[section])


def flatten_yaml(data: dict, *, source: str = "config") -> dict[str, Any]:
    """Flatten a sectioned (or flat) YAML mapping to option names, refusing unknown keys (with the closest known
    one) and values of the wrong type (``file.yaml: data.max_length: expected int, got 'long'``)."""
    owner = _field_owner()
    flat: dict[str, Any] = {}
    for key, value in (data or {}).items():
        if key in SECTIONS:
            if not isinstance(value, dict):
                raise ConfigError(f"{source}: section '{key}' must be a mapping, got {value!r}")
            for sub, sub_value in value.items():
                if owner.get(sub) != key:
                    hint = (f" (it belongs in section '{owner[sub]}')" if sub in owner else
                            did_you_mean(str(sub), [k for k, o in owner.items() if o == key], prefix=f"{key}.")
                            or did_you_mean(str(sub), owner))
                    raise ConfigError(f"{source}: unknown key '{key}.{sub}'{hint}")
                flat[sub] = sub_value
        elif key in owner:
            flat[key] = value
        else:
            raise ConfigError(
                f"{source}: unknown key '{key}'{did_you_mean(str(key), [*SECTIONS, *owner])}; sections are "
                f"{', '.join(SECTIONS)} and options are listed by --help"
            )
    for name, value in flat.items():
        problem = _type_problem(value, _section_hints(owner[name])[name])
        if problem:
            raise ConfigError(f"{source}: {owner[name]}.{name}: {problem}")
    return flat


def build_parser(defaults: Optional[dict[str, Any]] = None):
    from transformers import HfArgumentParser

    parser = HfArgumentParser(tuple(SECTIONS.values()), description="dpllm run configuration", allow_abbrev=False)
    parser.add_argument("--config", default=None, help="YAML file with model/data/train/privacy sections.")
    if defaults:
        parser.set_defaults(**defaults)
    return parser


@dataclass(frozen=True)
class OptionNames:
    """How a user sets the options that error messages tell them to change: the recipe's flags, or the
    ``DPTrainer`` fields and ``train()`` argument (a message names what the reader actually types)."""

    overwrite: str = "--overwrite_output_dir true"
    resume: str = "--resume_from latest"
    save: str = "--save_every N"
    output_dir: str = "--output_dir"


CLI_OPTIONS = OptionNames()
TRAINER_OPTIONS = OptionNames(overwrite="PrivacyArguments(overwrite_output_dir=True)",
                              resume="trainer.train(resume_from_checkpoint=True)",
                              save="TrainingArguments(save_steps=N)", output_dir="TrainingArguments(output_dir=...)")


def parse_config(argv: Optional[list[str]] = None) -> RunConfig:
    """Parse ``--config file.yaml`` plus ``--key value`` overrides into a validated :class:`RunConfig`.

    Raises:
        ConfigError: unknown keys in the YAML, or values that cannot work together.
        SystemExit: unknown command-line options (argparse's own error message).
    """
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    defaults: dict[str, Any] = {}
    if sum(a == "--config" or a.startswith("--config=") for a in argv) > 1:
        raise ConfigError("--config was given more than once; merge the files into one YAML (only one is read)")
    argv = [x for a in argv for x in (a.split("=", 1) if a.startswith("--config=") else [a])]
    if "--config" in argv:
        i = argv.index("--config")
        if i + 1 >= len(argv):
            raise ConfigError("--config needs a YAML file path")
        path = Path(argv[i + 1])
        if not path.is_file():
            from dpllm.io import suggest_path

            near = suggest_path(str(path))
            raise ConfigError(f"--config {path}: file not found" + (f"; did you mean {near}?" if near else ""))
        defaults = flatten_yaml(load_yaml(path.read_text()) or {}, source=str(path))
    argv = _undot(argv)
    parser = build_parser(defaults)
    known = parser._option_string_actions  # every flag, --no_X of a boolean included
    for arg in argv:
        flag = arg.split("=", 1)[0]
        if flag.startswith("--") and len(flag) > 2 and flag not in known:
            raise ConfigError(f"unknown option {flag}{did_you_mean(flag, known)}; options are listed by --help")
    try:
        parsed = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as err:  # HfArgumentParser's "arguments are not used" message
        raise ConfigError(f"{err}; run with --help for the list of options") from err
    cfg = RunConfig(*parsed[: len(SECTIONS)])
    _command_line_steps_win(cfg, argv, from_file=defaults)
    validate(cfg)
    return cfg


def _command_line_steps_win(cfg: RunConfig, argv: list[str], *, from_file: dict[str, Any]) -> None:
    """``--max_steps N`` on the command line over a config file's ``epochs``: the command line wins.

    ``max_steps`` is ignored when ``epochs`` is set, so ``--config x.yaml --max_steps 20`` on a file with
    ``epochs: 1`` used to run the file's epochs without a word. Now the command line's ``--max_steps`` replaces
    the file's ``epochs`` (logged); with ``--epochs`` on the command line as well, ``epochs`` decides as documented
    and the ignored ``--max_steps`` is named in a warning.
    """
    flags = {a.split("=", 1)[0] for a in argv}
    if "--max_steps" not in flags or cfg.train.epochs is None:
        return
    log = logging.getLogger(__name__)
    if "--epochs" in flags:
        log.warning("--max_steps %s is ignored: --epochs %s sets the run's length", cfg.train.max_steps,
                    cfg.train.epochs)
    elif from_file.get("epochs") is not None:
        log.info("--max_steps %s replaces the config file's epochs: %s", cfg.train.max_steps, cfg.train.epochs)
        cfg.train.epochs = None


def check_paths(cfg: RunConfig) -> None:
    """Refuse a local data or model path that does not exist ("did you mean ...?") and an output directory
    that cannot be created, in milliseconds, before torch or a model is loaded.

    Names that are not paths (Hub ids, built-in data sets, tiny models) pass; the loaders check them.

    Raises:
        ConfigError: naming the option, the value and the closest existing path.
    """
    from dpllm.io import missing_path_error, output_dir_error

    checks = [missing_path_error(cfg.data.dataset, option="dataset"),
              missing_path_error(cfg.model.model_name_or_path, option="model_name_or_path"),
              output_dir_error(cfg.train.output_dir)]
    resume_from = cfg.train.resume_from
    if resume_from and resume_from != "latest":
        checks.append(missing_path_error(resume_from, option="resume_from"))
    for problem in checks:
        if problem:
            raise ConfigError(problem)


def _undot(argv: list[str]) -> list[str]:
    """Accept ``--section.key value`` (torchtune style) as well as ``--key value``."""
    owner = _field_owner()
    out = []
    for arg in argv:
        if arg.startswith("--") and "." in arg.split("=", 1)[0]:
            name, _, rest = arg[2:].partition("=")
            section, _, key = name.partition(".")
            if owner.get(key) != section:
                near = did_you_mean(name, [f"{o}.{k}" for k, o in owner.items()], prefix="--")
                raise ConfigError(f"unknown option --{name}{near}; options are listed by --help")
            arg = f"--{key}" + (f"={rest}" if rest else "")
        out.append(arg)
    return out


def config_from_dict(data: dict) -> RunConfig:
    """Build a :class:`RunConfig` from a (sectioned or flat) mapping, e.g. a saved ``config.yaml``."""
    flat = flatten_yaml(data)
    owner = _field_owner()
    parts: dict[str, dict] = {name: {} for name in SECTIONS}
    for key, value in flat.items():
        parts[owner[key]][key] = value
    cfg = RunConfig(**{name: SECTIONS[name](**parts[name]) for name in SECTIONS})
    validate(cfg)
    return cfg


def load_config_file(path: str | Path) -> RunConfig:
    return config_from_dict(load_yaml(Path(path).read_text()) or {})


def _choice(name: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{name}={value!r} is not supported; choose one of {', '.join(allowed)}")


NOISE_SCHEDULES = ("constant", "linear", "exponential")


def schedule_problem(kind: str, end: float, pieces: int) -> Optional[str]:
    """What is wrong with a noise schedule's shape (the ``noise_schedule*`` keys), or None when nothing is.

    One rule for both places a schedule is built: :func:`validate` (a :class:`ConfigError` before anything
    runs) and :class:`dpllm.privacy.schedule.NoiseSchedule` (a ``ScheduleError`` for one built in code).
    """
    if kind not in NOISE_SCHEDULES:
        return f"privacy.noise_schedule={kind!r}; choose one of {', '.join(NOISE_SCHEDULES)}"
    if kind != "constant":
        if not (end > 0 and end == end and end != float("inf")):
            return (f"privacy.noise_schedule_end={end} must be a positive finite multiplier "
                    "(σ of the last piece / σ of the first; < 1 decays)")
        if int(pieces) != pieces or pieces < 2:
            return f"privacy.noise_schedule_pieces={pieces} must be an integer ≥ 2 for a {kind} schedule"
    return None


QUANTIZATIONS = ("none", "nf4", "fp4", "int8")
from dpllm.errors import QLORA_EXTRA  # noqa: E402 (one line names the extra; errors imports no torch)


def check_quantization(m: "ModelConfig") -> None:
    """Refuse a quantization that cannot run: an unknown kind, full fine-tuning of a quantized base, or
    bitsandbytes missing (found without importing it, before any model loads).

    Raises:
        ConfigError: naming the value and what to change.
    """
    _choice("quantization", m.quantization, QUANTIZATIONS)
    if m.quantization == "none":
        return
    if m.finetuning != "lora":
        raise ConfigError(f"quantization={m.quantization} freezes the base in {m.quantization} weights, which "
                          "cannot be trained: use finetuning: lora (QLoRA), or quantization: none for "
                          f"finetuning={m.finetuning}")
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(f"quantization={m.quantization} needs bitsandbytes, which is not installed: {QLORA_EXTRA} "
                          "(or pip install 'bitsandbytes>=0.45'), or set quantization: none")


def _check_split(cfg: RunConfig) -> None:
    """``long_records: split``: refuse what it cannot do yet, one line each (issue 48)."""
    d, t, p = cfg.data, cfg.train, cfg.privacy
    if d.max_windows < 1:
        raise ConfigError(f"max_windows={d.max_windows} must be ≥ 1 (the windows kept of one long record)")
    if not 0 <= d.window_stride < d.max_length:
        raise ConfigError(f"window_stride={d.window_stride} must be ≥ 0 and < max_length={d.max_length}: it is the "
                          "overlap, the tokens a window repeats from the one before as context, so each window must "
                          "add at least one new token; lower it")
    if d.privacy_unit != "record":
        raise ConfigError(f"long_records=split keeps the record as the privacy unit; with privacy_unit="
                          f"{d.privacy_unit} it is planned (issue 48), not yet built: use long_records: truncate")
    if d.data_format in ("messages", "prompt_completion"):
        raise ConfigError(f"long_records=split of data_format={d.data_format} records (a conversation cut between "
                          "windows) is planned (issue 48); use long_records: truncate, or raise max_length")
    if p.enabled and d.max_windows > t.physical_batch_size:
        raise ConfigError(f"max_windows={d.max_windows} > physical_batch_size={t.physical_batch_size}: a record's "
                          "windows are clipped together in one backward pass; lower max_windows or raise "
                          "physical_batch_size")
    if p.enabled and p.grad_sample_mode in ("ghost", "ghost_fsdp"):
        raise ConfigError(f"long_records=split needs grad_sample_mode: bk, auto or hooks, not {p.grad_sample_mode}: "
                          "a record's gradient is the sum over its windows before clipping, and Opacus's ghost "
                          "clipping cannot add the cross terms between them")


def _check_packing(cfg: RunConfig) -> None:
    """``packing: true``: refuse what it cannot do, one line each (issue 48; dpllm.packing)."""
    d, p = cfg.data, cfg.privacy
    if d.privacy_unit != "record":
        raise ConfigError(f"packing=true packs records and clips each one alone (privacy_unit=record); with "
                          f"privacy_unit={d.privacy_unit} it is not built: set packing: false")
    if p.enabled and p.grad_sample_mode not in ("bk", "auto"):
        raise ConfigError(f"packing=true needs grad_sample_mode: bk (or auto on a model bk supports), not "
                          f"{p.grad_sample_mode}: only bk clips each record's segment of a packed row alone")
    if p.enabled and p.clipping == "quantile":
        raise ConfigError("packing=true with clipping: quantile is not built yet (its count of records under C is "
                          "not tested over packed rows); use clipping: flat, or packing: false")
    if p.enabled and p.noise != "independent":
        raise ConfigError(f"packing=true with noise: {p.noise} is not built yet (the cyclic group sampler over packed "
                          "rows is not tested, issue 45); use noise: independent, or packing: false")


def validate(cfg: RunConfig) -> None:
    """Check values that need no data or model; raise :class:`ConfigError` naming the fix."""
    m, d, t, p = cfg.model, cfg.data, cfg.train, cfg.privacy
    _choice("finetuning", m.finetuning, ("lora", "full"))
    _choice("torch_dtype", m.torch_dtype, ("float32", "bfloat16", "float16", "auto"))
    check_quantization(m)
    _choice("optimizer", t.optimizer, ("adamw", "sgd"))
    _choice("lr_scheduler", t.lr_scheduler, ("constant", "linear", "cosine"))
    _choice("mixed_precision", t.mixed_precision, ("no", "bf16"))
    _choice("train_on", d.train_on, ("private", "public"))
    from dpllm.canaries import DESIGNS, NEEDS_TOKENS

    _choice("canary_design", d.canary_design, tuple(DESIGNS))
    if d.num_canaries and d.canary_design in NEEDS_TOKENS and m.finetuning != "full":
        raise ConfigError(f"canary_design={d.canary_design} trains new vocabulary rows, which "
                          f"finetuning={m.finetuning} keeps frozen (every canary would score alike); use "
                          "finetuning: full for the audit run, or another canary design")
    _choice("accountant", p.accountant, ("prv", "rdp", "gdp", "pld"))
    _choice("grad_sample_mode", p.grad_sample_mode, ("ghost", "hooks", "ghost_fsdp", "bk", "auto"))
    _choice("privacy_unit", d.privacy_unit, ("record", "user", "sequence"))
    _choice("data_format", d.data_format, ("auto", "messages", "prompt_completion", "text"))
    _choice("loss_on", d.loss_on, ("answer", "all"))
    _choice("user_sampling", p.user_sampling, ("uls", "els", "record"))
    if d.record_fraction is not None and not (0 < d.record_fraction <= 1):
        raise ConfigError(f"record_fraction={d.record_fraction} must be in (0, 1] (the expected fraction of records "
                          "kept); unset it to keep every record")
    if d.max_records_per_user is not None and d.max_records_per_user < 1:
        raise ConfigError(f"max_records_per_user={d.max_records_per_user} must be ≥ 1 (or unset: keep all records)")
    if d.canary_records_per_user < 1 or (d.canary_records_per_user > 1 and d.privacy_unit != "user"):
        raise ConfigError(f"canary_records_per_user={d.canary_records_per_user} must be 1, or > 1 with "
                          "privacy_unit=user (a canary user)")
    if d.max_records_per_user is not None and d.canary_records_per_user > d.max_records_per_user:
        raise ConfigError(f"canary_records_per_user={d.canary_records_per_user} > max_records_per_user="
                          f"{d.max_records_per_user}: a canary user would break the contribution bound; lower it")
    if d.privacy_unit == "user" and p.enabled and p.user_sampling == "els" and d.max_records_per_user is None:
        # k of the group privacy is the declared cap, never the data's largest user (a neighbour may add any user)
        raise ConfigError("user_sampling=els accounts for users of at most max_records_per_user records, and none is "
                          "set: set max_records_per_user (e.g. 8), or use user_sampling: uls")
    if d.privacy_unit == "user" and p.enabled and p.user_sampling == "uls":
        if p.grad_sample_mode in ("ghost", "ghost_fsdp"):
            raise ConfigError(
                f"user_sampling=uls needs grad_sample_mode: bk, auto or hooks, not {p.grad_sample_mode}: a user's "
                "gradient is the mean of its records' gradients before clipping, and Opacus's ghost clipping has no "
                "way to add the cross terms between them; set grad_sample_mode: bk, or use user_sampling: els")
    _choice("long_records", d.long_records, ("truncate", "split"))
    if d.long_records == "split":
        _check_split(cfg)
    elif d.window_stride:
        raise ConfigError(f"window_stride={d.window_stride} is the overlap between the windows of long_records: "
                          "split; with long_records: truncate there are no windows: unset it, or set long_records: "
                          "split")
    if d.packing:
        _check_packing(cfg)
    if d.max_length < 2:
        raise ConfigError(f"max_length={d.max_length}: need at least 2 tokens for next-token loss")
    if not (0 <= d.public_fraction < 1) or not (0 < d.heldout_fraction < 1):
        raise ConfigError("public_fraction must be in [0, 1) and heldout_fraction in (0, 1)")
    if d.public_fraction > 0 and not d.simulate_public_from_private:
        raise ConfigError(f"public_fraction={d.public_fraction:g} would train on records of the private file "
                          "without DP; put public records in public_dataset: FILE, or (a study only) set "
                          "simulate_public_from_private: true")
    if d.public_fraction > 0 and d.public_dataset:
        raise ConfigError("public_fraction and public_dataset both set: declare public data one way (unset "
                          "public_fraction)")
    if not d.deduplicate and d.privacy_unit == "user":
        raise ConfigError("deduplicate=false needs privacy_unit=record: at user level a user's repeated text is one "
                          "record (the cap counts distinct records); set deduplicate: true")
    if t.logical_batch_size < 1 or t.physical_batch_size < 1:
        raise ConfigError("logical_batch_size and physical_batch_size must be positive")
    if t.physical_batch_size > t.logical_batch_size:
        raise ConfigError(
            f"physical_batch_size={t.physical_batch_size} > logical_batch_size={t.logical_batch_size}; "
            "lower physical_batch_size"
        )
    if t.epochs is None and (t.max_steps is None or t.max_steps < 1):
        raise ConfigError("set max_steps ≥ 1 or epochs > 0")
    if t.epochs is not None and t.epochs <= 0:
        raise ConfigError(f"epochs={t.epochs} must be positive")
    for name, value in (("target_epsilon", p.target_epsilon), ("target_delta", p.target_delta),
                        ("noise_multiplier", p.noise_multiplier), ("max_grad_norm", p.max_grad_norm),
                        ("learning_rate", t.learning_rate), ("epochs", t.epochs)):
        if value is not None and not math.isfinite(value):
            hint = "; for a run without DP set privacy.enabled=false" if name == "target_epsilon" else ""
            raise ConfigError(f"{name}={value} must be a finite number{hint}")
    _check_numbers(cfg)
    if p.enabled:
        if p.max_grad_norm <= 0:
            raise ConfigError(f"max_grad_norm={p.max_grad_norm} must be positive")
        if p.noise_multiplier is None and p.target_epsilon is None:
            raise ConfigError("privacy is enabled: set target_epsilon (calibrates noise) or noise_multiplier")
        if p.target_epsilon is not None and p.target_epsilon <= 0:
            raise ConfigError(f"target_epsilon={p.target_epsilon} must be positive")
        if not 0 < p.target_delta < 1:
            raise ConfigError(f"target_delta={p.target_delta} must be in (0, 1), and below 1/N for N records")
        if p.noise_multiplier is not None and p.noise_multiplier <= 0:
            raise ConfigError(f"noise_multiplier={p.noise_multiplier} must be positive under DP")
        problem = schedule_problem(p.noise_schedule, p.noise_schedule_end, p.noise_schedule_pieces)
        if problem:  # a bad kind, end or piece count
            raise ConfigError(problem)
        if p.noise_schedule != "constant" and d.privacy_unit == "user" and p.user_sampling == "els":
            raise ConfigError("noise_schedule with user_sampling=els is not supported yet (its user-level mixture "
                              "accounting calibrates one σ); use user_sampling=uls or noise_schedule=constant")
        if d.train_on == "public":
            raise ConfigError(
                "train_on=public trains on the public split, which needs no DP: set privacy.enabled=false"
            )
        problem = quantile_problem(cfg) or correlated_problem(cfg)
        if problem:
            raise ConfigError(problem)


def quantile_problem(cfg: RunConfig) -> Optional[str]:
    """Why ``clipping: quantile`` cannot run with this configuration (dpllm.privacy.quantile), or None.

    Only what is covered runs: bk (one process, DDP, FSDP2, QLoRA), hooks or ghost (one process, DDP), any privacy
    unit (a user, a long record over its windows: the unit's bit counted once), a constant σ or a schedule. Anything
    else is refused in one line rather than run with an accounting nobody checked.
    """
    p = cfg.privacy
    if p.clipping != "quantile":
        return None
    # Every unit (record, sequence, user, or a long record over its windows) is clipped once per step, in one
    # physical batch on one process, so its centred bit enters the count once: ½ per unit, as for records.
    # A noise schedule: each step's pair is split from that step's σ_t (dpllm.privacy.quantile).
    if p.grad_sample_mode == "ghost_fsdp":  # Opacus's FSDP optimizer: no count noised across shards yet
        return "clipping: quantile is not yet supported with grad_sample_mode=ghost_fsdp"
    return None


def correlated_problem(cfg: RunConfig) -> Optional[str]:
    """Why ``noise: banded`` or ``blt`` cannot run with this configuration (dpllm.privacy.correlated), or None.

    What runs: bk (one process, DDP: rank 0 noises and keeps the recurrence, FSDP2: each process over its shards),
    Opacus hooks and ghost (one process, DDP: rank 0), record level or ULS (a user is grouped and sampled as the
    unit), a constant σ, any fixed-norm clipping function; banded and blt alike. What the amplified reduction
    (Choquette-Choo et al. 2023, arXiv 2306.08153, Thm 1: one σ and one clip norm at every step, every unit in one
    cyclic group) or BLT's Gaussian mechanism (the same participation, sensitivity sens(C, b, ⌈T/b⌉) at one clip norm)
    does not cover is refused in one line that says why; the rest is refused until it is built (issue 45).
    """
    p = cfg.privacy
    if p.noise not in ("independent", "banded", "blt"):
        return f"privacy.noise={p.noise!r}; choose one of independent, banded, blt"
    bands = str(p.bands).strip()
    if bands != "auto" and not (bands.isdigit() and int(bands) >= 1):
        return f"privacy.bands={p.bands!r}: give 'auto' or a positive whole number of bands"
    buffers = str(p.buffers).strip()
    if buffers != "auto" and not (buffers.isdigit() and 1 <= int(buffers) <= 8):
        return f"privacy.buffers={p.buffers!r}: give 'auto' or a whole number of BLT buffers from 1 to 8"
    if buffers != "auto" and p.noise != "blt":
        return f"privacy.buffers={p.buffers} needs privacy.noise=blt"
    if p.noise == "independent":
        return None if bands in ("auto", "1") else f"privacy.bands={p.bands} needs privacy.noise=banded"
    # blt: one Gaussian mechanism whose sensitivity needs only that every unit (a record, or a ULS user) is clipped to C
    # once per step and joins only its cyclic group's steps; the engine that clips and the process that noises (bk,
    # hooks or ghost; rank 0 under DDP) change neither, so blt runs where banded does (dpllm.privacy.correlated)
    return _correlated_scope(cfg)


# Why the amplified reduction does not cover these (one line each; tests/test_correlated_engines.py checks them)
CORRELATED_SCHEDULE = (
    "noise_schedule={kind} with privacy.noise: {noise}: the reduction (arXiv 2306.08153, Thm 1) is proved for one σ at "
    "every step, and a unit's clipped gradient is noised again in the rows of the next b steps, so a σ that falls "
    "inside them noises it less than the σ accounted for its step; use noise_schedule: constant")
CORRELATED_QUANTILE = (
    "clipping: quantile with privacy.noise: {noise}: the reduction (arXiv 2306.08153, Thm 1) needs one clip norm at "
    "every step; a gradient clipped at C_t is noised again at σ·C_(t+k) in the next b rows, so a falling C gives it "
    "more than the sensitivity accounted, and the count's release is a second mechanism the reduction does not "
    "include; use clipping: flat (or another fixed-norm function)")
CORRELATED_USER_GROUPS = (
    "user_sampling={sampling} with privacy.noise: {noise}: records are put in cyclic groups one by one, so one user's "
    "records can sit in different groups and the user joins more than ceil(T/b) steps, which the group-privacy "
    "accounting of {sampling} (made for DP-SGD's participation) does not cover; use user_sampling: uls (each user is "
    "grouped and sampled as the unit)")
CORRELATED_SEQUENCE = (
    "privacy_unit=sequence with privacy.noise: {noise}: a record cut across two blocks is covered by group privacy "
    "over the blocks, which can sit in different cyclic groups (more than ceil(T/b) steps); use privacy_unit: record")


def _correlated_scope(cfg: RunConfig) -> Optional[str]:
    """The engines, units and options a correlated mechanism runs with (:func:`correlated_problem`), or why not."""
    p, d, noise = cfg.privacy, cfg.data, cfg.privacy.noise
    if p.grad_sample_mode == "ghost_fsdp":
        return (f"privacy.noise: {noise} is not built for grad_sample_mode=ghost_fsdp (Opacus's FSDP optimizer); "
                "use grad_sample_mode: bk (or auto) under FSDP")
    if p.noise_schedule != "constant":
        return CORRELATED_SCHEDULE.format(kind=p.noise_schedule, noise=noise)
    if p.clipping == "quantile":
        return CORRELATED_QUANTILE.format(noise=noise)
    if d.privacy_unit == "user" and p.user_sampling != "uls":
        return CORRELATED_USER_GROUPS.format(sampling=p.user_sampling, noise=noise)
    if d.privacy_unit == "sequence":
        return CORRELATED_SEQUENCE.format(noise=noise)
    if d.long_records == "split":
        return f"privacy.noise: {noise} is not yet supported with long_records=split (issue 45)"
    return None


# option → (lowest allowed, whether the lowest is allowed, highest (exclusive) or None, what the option does when
# off or why the bound). Checked before anything loads: a negative learning rate otherwise fails in torch's
# optimizer after the model has loaded (minutes on a large model).
_RANGES: dict[str, tuple[float, bool, Optional[float], str]] = {
    "learning_rate": (0, False, None, "the optimizer's step size, e.g. 1e-4 to 1e-3"),
    "weight_decay": (0, True, None, "0 turns it off"),
    "momentum": (0, True, 1, "0 turns it off"),
    "warmup_steps": (0, True, None, "0 turns it off"),
    "eval_every": (0, True, None, "0 evaluates only at the start and the end"),
    "eval_max_records": (1, True, None, "unset it to use every held-out record"),
    "log_every": (1, True, None, "1 logs every step"),
    "save_every": (0, True, None, "0 or unset writes no resumable checkpoints"),
    "save_every_minutes": (0, True, None, "0 writes no time-based checkpoints"),
    "max_records": (1, True, None, "unset it to use every record"),
    "min_chars": (0, True, None, "0 keeps every non-empty record"),
    "num_canaries": (0, True, None, "0 adds none"),
    "lora_r": (1, True, None, "the adapter rank"),
    "lora_alpha": (0, False, None, "the adapter scale"),
    "lora_dropout": (0, True, 1, "0 turns it off"),
    "tiny_hidden_size": (1, True, None, "a layer width"),
    "tiny_num_layers": (1, True, None, "a layer count"),
    "tiny_num_heads": (1, True, None, "a head count"),
    "tiny_intermediate_size": (1, True, None, "a layer width"),
    "tiny_max_positions": (2, True, None, "the context length"),
    "clipping_r": (0, False, None, "the clipping function's stability constant"),
    "clipping_s": (0, False, None, "the clipping function's scale"),
    "target_quantile": (0, False, 1, "the quantile of the per-record norms that clipping: quantile tracks"),
    "quantile_lr": (0, True, None, "the learning rate of clipping: quantile's C; 0 keeps C fixed"),
    "count_noise_multiplier": (0, False, None, "the noise of clipping: quantile's count; unset: expected batch / 20"),
}


def _check_numbers(cfg: RunConfig) -> None:
    """Refuse numeric options outside their range (:data:`_RANGES`), naming the value and the range."""
    values = {k: v for section in SECTIONS for k, v in asdict(getattr(cfg, section)).items()}
    for name, (low, low_ok, high, why) in _RANGES.items():
        value = values[name]
        if value is None:
            continue
        ok = (isinstance(value, (int, float)) and math.isfinite(value)
              and (value >= low if low_ok else value > low) and (high is None or value < high))
        if not ok:
            bound = (f"≥ {low:g}" if low_ok else f"> {low:g}") + (f" and < {high:g}" if high is not None else "")
            raise ConfigError(f"{name}={value} must be {bound} ({why})")
