"""Fine-tune an MoE model with Occult (pruning-aware SFT) through HF `Trainer`: `python -m occult_hf.hf.finetune`.

    python -m occult_hf.hf.finetune --model_name_or_path allenai/OLMoE-1B-7B-0924 --train_file train.jsonl \
        --output_dir sft_pruned --num_devices 8 --logical_devices --prune router --max_devices_per_token 2 \
        --max_steps 200 --bf16
    torchrun --nproc-per-node 8 -m occult_hf.hf.finetune ... --num_devices 8          # expert parallelism
    accelerate launch --multi_gpu --num_processes 2 -m occult_hf.hf.finetune ... --num_devices 2 --use_cpu   # CPU

Arguments are parsed by `transformers.HfArgumentParser` into `ModelArguments`, `DataArguments`,
`OccultArguments` and `TrainingArguments`, so every Trainer flag works (`--learning_rate`,
`--save_steps`, `--resume_from_checkpoint`, `--report_to`, ...; `--flag_name` and `--flag-name` are
both accepted), and a JSON file of them may be given instead (`python -m occult_hf.hf.finetune args.json`).

The data (`--train_file`: a .txt/.json/.jsonl/.csv/.parquet file, a `save_to_disk` directory, a local
dataset directory or a hub dataset; `--dataset_config`, `--text_column`) is read with `datasets`,
tokenised, joined with EOS and cut into `--seq_len` blocks. Under `torchrun` or `accelerate launch
--multi_gpu` the processes form the EP group (`--num_devices` must equal their number; on a machine
without GPUs with `--use_cpu`, else the Trainer counts one process: an error); in one process
`--num_devices N` > 1 needs `--logical_devices` (N logical devices: pruning plans for N devices, no EP
runs), so that a launch that quietly started one process (`accelerate launch` without `--multi_gpu`
on a machine without GPUs) is an error rather than a run that looks like EP (`hf.launch`).
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass, field

from ..pruning import pruning_policy_names
from ..utils.checks import check_count


@dataclass
class ModelArguments:
    model_name_or_path: str = field(metadata={"help": "A checkpoint directory or hub id (from_pretrained)."})
    dtype: str = field(default="auto", metadata={"help": "Weights dtype: auto, float32, bfloat16, float16."})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow the checkpoint's own modelling code."})


@dataclass
class DataArguments:
    train_file: str = field(
        metadata={
            "help": "Training text: a local .txt/.json/.jsonl/.csv/.parquet file, a save_to_disk directory, a local "
            "dataset directory or a hub dataset name (read with datasets)."
        }
    )
    dataset_config: str | None = field(default=None, metadata={"help": "Dataset configuration name."})
    split: str = field(default="train", metadata={"help": "Dataset split."})
    text_column: str = field(default="text", metadata={"help": "Column holding the text."})
    seq_len: int = field(default=1024, metadata={"help": "Tokens per training sequence (documents are packed)."})

    def __post_init__(self) -> None:
        check_count("--seq_len", self.seq_len, 1)


@dataclass
class OccultArguments:
    num_devices: int | None = field(
        default=None,
        metadata={"help": "Devices of the EP group: the number of processes (default), or logical devices in one process."},
    )
    logical_devices: bool = field(
        default=False,
        metadata={"help": "Allow num_devices > 1 in one process (logical devices; no expert parallelism runs)."},
    )
    placement: str = field(default="contiguous", metadata={"help": "'contiguous' or an occult_placement.json."})
    prune: str = field(default="router", metadata={"help": "Collaboration pruning: router, similarity or none."})
    max_devices_per_token: int | None = field(
        default=None, metadata={"help": "N_d: the most devices per token when pruning (default: 2, or num_devices if fewer)."}
    )
    profile: str | None = field(default=None, metadata={"help": "Routing profile, needed by --prune similarity."})
    schedule_fraction: float = field(
        default=0.25,
        metadata={"help": "Fraction of the run's optimizer steps (max_steps, or those of num_train_epochs) over which N_d eases from no pruning to its target."},
    )
    check_every: int = field(default=100, metadata={"help": "Drift watch every this many steps (0: only at saves)."})
    lora: bool = field(default=False, metadata={"help": "LoRA on attention and the fused experts (else MoE-only full FT)."})
    lora_rank: int = field(default=16, metadata={"help": "LoRA rank r (lora_alpha = 2 r)."})
    per_layer_metrics: bool = field(default=False, metadata={"help": "Also log every layer's occult/ metrics."})

    def __post_init__(self) -> None:
        if self.prune not in (*pruning_policy_names(), "none"):  # the registry's names now, plugins included
            raise ValueError(f"--prune must be one of {(*pruning_policy_names(), 'none')}, got {self.prune!r}")
        if not 0.0 <= self.schedule_fraction <= 1.0:
            raise ValueError(f"--schedule_fraction must be in [0, 1], got {self.schedule_fraction}")
        if self.max_devices_per_token is not None:
            check_count("--max_devices_per_token", self.max_devices_per_token, 1)
        check_count("--check_every", self.check_every, 0, meaning=" (0: only at saves)")
        check_count("--lora_rank", self.lora_rank, 1)


def parse_arguments(argv: list[str] | None = None):
    """`(ModelArguments, DataArguments, OccultArguments, TrainingArguments)` from argv or one JSON file."""
    from transformers import HfArgumentParser, TrainingArguments

    parser = HfArgumentParser((ModelArguments, DataArguments, OccultArguments, TrainingArguments))
    argv = sys.argv[1:] if argv is None else list(argv)
    if len(argv) == 1 and argv[0].endswith(".json"):
        return parser.parse_json_file(argv[0])
    return parser.parse_args_into_dataclasses(args=argv)


def packed_dataset(data, tokenizer, seq_len: int, text_column: str, training_args):
    """Tokenise, join with EOS, cut into `seq_len` blocks; an error when not one block fits."""
    if tokenizer.eos_token is None:
        raise ValueError("the tokenizer has no eos_token to join documents with")

    def tokenize(batch):
        return tokenizer([text + tokenizer.eos_token for text in batch[text_column]])

    def pack(batch):
        ids = [token for document in batch["input_ids"] for token in document]
        return {"input_ids": [ids[s : s + seq_len] for s in range(0, len(ids) - seq_len + 1, seq_len)]}

    with training_args.main_process_first():
        tokens = data.map(tokenize, batched=True, remove_columns=data.column_names)
        total = sum(len(ids) for ids in tokens["input_ids"])
        if total < seq_len:
            raise ValueError(
                f"the training data holds {total} tokens, shorter than one sequence of --seq_len {seq_len}; "
                f"give more text or a smaller --seq_len"
            )
        return tokens.map(pack, batched=True, batch_size=None, remove_columns=tokens.column_names)


def main(argv: list[str] | None = None) -> int:
    """Run the fine-tuning; an error ends in one line on stderr and exit code 2 (`OCCULT_DEBUG=1`: the traceback), as
    the `occult` commands do, on every rank under a launcher."""
    from ..utils.errors import run_command

    return run_command("occult_hf.hf.finetune", lambda: _finetune(argv))


def _finetune(argv: list[str] | None) -> int:
    from ..utils.checks import check_model_source
    from ..utils.progress import progress_bars_off

    model_args, data_args, occult_args, training_args = parse_arguments(argv)
    check_model_source(model_args.model_name_or_path)  # a missing directory at once, not after the Hub's retries
    with progress_bars_off() if training_args.disable_tqdm else contextlib.nullcontext():  # every bar, not the Trainer's alone
        return _train(model_args, data_args, occult_args, training_args)


def _train(model_args, data_args, occult_args, training_args) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer

    from ..config import OccultConfig
    from .callback import OccultCallback
    from .launch import check_launch, check_trainer_sees_the_processes
    from .text_data import load_text_dataset

    # TrainingArguments (built above) has initialised torch.distributed under torchrun/accelerate
    num_devices = check_launch(occult_args.num_devices, occult_args.logical_devices)
    check_trainer_sees_the_processes(training_args)
    pruned = occult_args.prune != "none"
    occult_config = OccultConfig(
        placement=occult_args.placement,
        num_devices=num_devices,
        prune=occult_args.prune if pruned else None,
        max_devices_per_token=(min(2, num_devices) if occult_args.max_devices_per_token is None else occult_args.max_devices_per_token)
        if pruned else None,
        profile=occult_args.profile,
        logical_devices=occult_args.logical_devices,
    )
    data = load_text_dataset(
        data_args.train_file, config=data_args.dataset_config, split=data_args.split, text_column=data_args.text_column
    )
    dtype = model_args.dtype if model_args.dtype == "auto" else getattr(torch, model_args.dtype)
    model = AutoModelForCausalLM.from_pretrained(
        model_args.model_name_or_path, dtype=dtype, occult_config=occult_config,
        trust_remote_code=model_args.trust_remote_code,
    )  # fmt: skip
    tokenizer = AutoTokenizer.from_pretrained(model_args.model_name_or_path, trust_remote_code=model_args.trust_remote_code)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    train_dataset = packed_dataset(data, tokenizer, data_args.seq_len, data_args.text_column, training_args)
    if occult_args.lora:
        from peft import LoraConfig

        from .peft_support import get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                r=occult_args.lora_rank, lora_alpha=2 * occult_args.lora_rank,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
            ),
        )  # fmt: skip
    callback = OccultCallback(
        schedule_fraction=occult_args.schedule_fraction if pruned else None,
        train_moe_only=not occult_args.lora,
        check_every=occult_args.check_every,
        per_layer=occult_args.per_layer_metrics,
    )
    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        processing_class=tokenizer,
        callbacks=[callback],
    )
    callback.attach(trainer)  # first in line, so that reporting integrations see its numbers
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    trainer.save_model()  # every rank: vanilla checkpoint (+ placement, occult_config) or the gathered adapter
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
