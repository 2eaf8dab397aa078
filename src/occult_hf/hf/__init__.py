"""The transformers wing: everything that knows transformers', accelerate's or peft's own objects.

- `apply`: `apply_occult` / `unapply_occult` on a loaded model, and `install()`, the loading hook that
  lets `from_pretrained` take `occult_config=`;
- `native_ep`: Occult as transformers' own expert-parallel implementation (`ep_implementation="occult"`);
- `loading`: each EP rank reads only its own experts at load;
- `compat`: every wrapper occult_hf puts on a transformers class, in one place;
- `checkpointing`, `trainer`, `callback`: vanilla saves gathered from the EP ranks, the Trainer's
  checkpoints and resume, `OccultCallback`;
- `launch`, `ddp`, `peft_support`, `decode`, `rehome`, `text_data`, `finetune`: launcher checks, DDP's
  ignore list, LoRA under EP, decoding, re-homing replicas, datasets input, the fine-tune script.

The runtime below (`occult_hf.moe`, `dispatch`, `experts`, `pruning`, `placement`) imports nothing from here.
"""
