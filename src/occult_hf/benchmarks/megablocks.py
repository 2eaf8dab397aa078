"""MegaBlocks' dMoE inside a transformers model: the `megablocks` rows of `occult bench paper`.

Shape legend: B sequences, S sequence length, T tokens, H hidden, E routed experts, k experts per token,
I expert width, L local experts of one rank.

MegaBlocks (databricks/megablocks 0.10.0, the paper's baseline) has no transformers integration: its `dMoE`
layer takes Megatron-style `Arguments`, holds its own router and its experts in its own layout, and runs
expert parallelism over a process group. `apply_megablocks` replaces every MoE block of a model (found by
the family's adapter in `patches/`) by a `MegaBlocksMoE` that holds a real `dMoE` with:

- **the model's own router** instead of dMoE's `LearnedRouter`: the block's router module runs, with the
  family's selection and weight rule (`adapter.route`). For the three models of the paper this is the same
  math as MegaBlocks' router (softmax over E, top-k, no renormalisation: their `norm_topk_prob` is False,
  MegaBlocks' `moe_normalize_expert_weights=None`), and it keeps the bench's routing replay (a hook on that
  module) working, so the MegaBlocks rows route exactly the tokens every other row routes;
- **the model's expert weights** in MegaBlocks' layout (`megablocks_expert_weights`): transformers'
  `gate_up_proj [E, 2I, H]` (gate rows first) and `down_proj [E, H, I]` become the GLU's `w1` (gate),
  `v1` (up) and `w2` (down, transposed), each `[L*I, H]`, rank r holding experts `[r*E/D, (r+1)*E/D)`
  (MegaBlocks has no placement: contiguous, like occult_hf's `contiguous` rows);
- **dropless** expert parallelism (`ParallelDroplessMLP`): one all-to-all row per (token, expert) pair,
  the counts through the host, the local experts as grouped GEMMs;
- the **shared experts** (Qwen1.5's sigmoid-gated one, DeepSeek's two) computed beside dMoE as the model
  defines them (`adapter.shared_output`), DeepSeek-MoE's dense first layer left as it is, and DeepSeek's
  sequence-level balance loss attached as the model does (to the routing weights, which reach the output
  through dMoE's weighted scatter: the same backward).

`mlp_impl="grouped"` (the `grouped_gemm` package; built as pip builds it, its per-expert cuBLAS path:
`GROUPED_GEMM_CUTLASS` unset). MegaBlocks' other expert kernel, `"sparse"` (stanford-stk's block-sparse
Triton kernels), is refused by megablocks 0.10.0 itself when triton >= 3.2 is installed ("Sparse MLP is not
supported with triton >=3.2.0"); the GPU machine has triton 3.6. `grouped_gemm` computes in bf16 only.
"""

from __future__ import annotations

import importlib

import torch
from torch import nn

#: MegaBlocks' expert kernel these rows use (see the module docstring for why not "sparse")
MLP_IMPL = "grouped"
#: what MegaBlocks needs and where this project keeps it (docs/paper_comparison.md, MegaBlocks)
INSTALL_HINT = (
    "build megablocks 0.10.0, stanford-stk 0.7.1 and grouped_gemm 0.3.0 from their sdists on a CUDA machine "
    "(bash docs/paper_x2.sh megablocks does it from .devdata/paper/megablocks_src)"
)


def megablocks_missing() -> str | None:
    """Why MegaBlocks' dMoE cannot run here (None: it can): each module it needs, tried in order."""
    needs = (
        ("megablocks", "the megablocks package"),
        ("megablocks_ops", "megablocks' CUDA extension (built only where torch is a CUDA build and CUDA_HOME is set)"),
        ("grouped_gemm", f"grouped_gemm, the kernels of mlp_impl={MLP_IMPL!r}"),
        ("megablocks.layers.dmoe", "megablocks.layers.dmoe"),
    )
    for module, what in needs:
        try:
            importlib.import_module(module)
        except Exception as error:  # noqa: BLE001 - an ImportError, or a broken build failing at import
            return f"{what} is not importable ({type(error).__name__}: {error}); {INSTALL_HINT}"
    return None


def megablocks_expert_weights(
    gate_up_proj_E2IH: torch.Tensor, down_proj_EHI: torch.Tensor, first: int, count: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Experts `first .. first+count-1` of transformers' fused weights in MegaBlocks' GLU layout.

    Returns `(w1_LIH, v1_LIH, w2_LIH)`, each `[count, I, H]` (MegaBlocks stores them flat, `[count*I, H]`):
    its `GroupedGLU` computes, per expert, `(act(x @ w1.T) * (x @ v1.T)) @ w2`, and transformers'
    `act(x @ gate.T) * (x @ up.T) @ down.T`, so `w1` is the gate half, `v1` the up half and `w2` the down
    projection transposed.
    """
    num_experts, two_width, hidden = gate_up_proj_E2IH.shape
    if first < 0 or count < 1 or first + count > num_experts:
        raise ValueError(f"experts {first}..{first + count - 1} are not among the {num_experts} experts")
    if two_width % 2 or down_proj_EHI.shape != (num_experts, hidden, two_width // 2):
        raise ValueError(
            f"gate_up_proj {tuple(gate_up_proj_E2IH.shape)} and down_proj {tuple(down_proj_EHI.shape)} are not "
            "transformers' fused layout [E, 2I, H] and [E, H, I]"
        )
    width = two_width // 2
    gate_up_L2IH = gate_up_proj_E2IH[first : first + count]
    w2_LIH = down_proj_EHI[first : first + count].transpose(1, 2)
    return gate_up_L2IH[:, :width], gate_up_L2IH[:, width:], w2_LIH


class _ModelRouter(nn.Module):
    """dMoE's router slot, filled by the model's own router: `(scores_TE, weights_Tk, ids_Tk)` as dMoE's
    `LearnedRouter` returns them, from the family's `adapter.route` (the block's router module runs)."""

    def __init__(self, block: nn.Module, adapter) -> None:
        super().__init__()
        self._block = (block,)  # a tuple: the router module is registered once, on MegaBlocksMoE
        self.adapter = adapter

    def forward(self, x_BSH: torch.Tensor):
        block = self._block[0]
        routing = self.adapter.route(block, x_BSH)
        weights_Tk = self.adapter.attach_aux_loss(block, routing.topk_weights_Tk.to(x_BSH.dtype), routing.aux_loss)
        return routing.logits_TE, weights_Tk, routing.topk_ids_Tk


def _no_init(tensor: torch.Tensor) -> None:
    """dMoE initialises weights it is about to be given: skip that work."""


class MegaBlocksMoE(nn.Module):
    """One MoE block run by MegaBlocks' `dMoE` (see the module docstring): the block's router and shared
    experts stay its own modules, its routed experts live in `dmoe.experts.mlp` (`w1`, `v1`, `w2`, this
    rank's `[L*I, H]` each). The replaced block is kept (unregistered) as `original_block`, so the family's
    adapter still finds its router; its routed-expert storage is released."""

    def __init__(self, block: nn.Module, adapter, num_moe_layers: int, group, dtype: torch.dtype) -> None:
        super().__init__()
        from megablocks.layers.arguments import Arguments
        from megablocks.layers.dmoe import dMoE

        if dtype != torch.bfloat16:
            raise ValueError(f"dtype is {dtype}, but MegaBlocks' mlp_impl={MLP_IMPL!r} (grouped_gemm) computes in bfloat16 only")
        self._original = (block,)
        self.adapter = adapter
        experts_module = adapter.experts_module(block)
        for name, child in block.named_children():
            if child is not experts_module:
                self.add_module(name, child)
        gate_up_E2IH, down_EHI = adapter.expert_weights(block)
        num_experts, two_width, hidden = gate_up_E2IH.shape
        world = torch.distributed.get_world_size(group) if group is not None else 1
        if num_experts % world:
            raise ValueError(f"MegaBlocks shards the {num_experts} experts evenly: num_experts must be divisible by the {world} ranks")
        args = Arguments(
            hidden_size=hidden, ffn_hidden_size=two_width // 2, num_layers=num_moe_layers, bias=False, return_bias=False,
            activation_fn=adapter.act_fn(block), moe_num_experts=num_experts, moe_top_k=adapter.router(block).top_k,
            moe_loss_weight=0.0,  # the model's own balance loss (DeepSeek's) is what trains, as in every other row
            moe_expert_model_parallelism=world > 1, expert_parallel_group=group if world > 1 else None,
            mlp_type="glu", mlp_impl=MLP_IMPL, fp16=False, bf16=True, device=gate_up_E2IH.device,
            init_method=_no_init, output_layer_init_method=_no_init,
        )  # fmt: skip
        self.dmoe = dMoE(args)
        self.dmoe.router = _ModelRouter(block, adapter)
        rank = torch.distributed.get_rank(group) if world > 1 else 0
        per_rank = num_experts // world
        mlp = self.dmoe.experts.mlp
        with torch.no_grad():
            for param, weight_LIH in zip((mlp.w1, mlp.v1, mlp.w2), megablocks_expert_weights(gate_up_E2IH, down_EHI, rank * per_rank, per_rank)):
                param.copy_(weight_LIH.reshape(param.shape))
            for param in (gate_up_E2IH, down_EHI):  # the block's own copies: only `mlp` computes now
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)

    @property
    def original_block(self) -> nn.Module:
        return self._original[0]

    def train(self, mode: bool = True) -> "MegaBlocksMoE":
        """Also the replaced block: the family reads its mode (DeepSeek-MoE computes its balance loss only in
        training), and being unregistered it would otherwise keep the mode it had when it was replaced."""
        super().train(mode)
        self.original_block.train(mode)
        return self

    def expert_parameter_names(self, prefix: str) -> list[str]:
        """This rank's expert parameters, named from the model (what DDP must not average across ranks)."""
        return [name for name, _ in self.dmoe.experts.mlp.named_parameters(prefix=f"{prefix}.dmoe.experts.mlp")]

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        shape = hidden_states.shape
        routed = self.dmoe(hidden_states)
        shared_TH = self.adapter.shared_output(self.original_block, hidden_states.reshape(-1, shape[-1]))
        return routed if shared_TH is None else routed + shared_TH.reshape(shape)


def apply_megablocks(model: nn.Module, group=None) -> nn.Module:
    """Replace every MoE block of `model` by a `MegaBlocksMoE` (expert parallelism over `group`, all ranks
    of it building the same model; None: one process), in place; returns `model`.

    Under expert parallelism the model's `_ddp_params_and_buffers_to_ignore` names every rank's own expert
    weights, so that DDP (for the replicated rest) neither broadcasts nor averages them: MegaBlocks scales
    their gradients by 1/D itself, the convention of DDP's average."""
    from occult_hf.patches import adapter_for

    adapter = adapter_for(model)
    blocks = list(adapter.iter_moe_blocks(model))
    if not blocks:
        raise ValueError(f"{type(model).__name__} has no MoE block that the {adapter.name!r} adapter knows")
    dtype = adapter.expert_weights(blocks[0][2])[0].dtype
    ignore = []
    for _, path, block in blocks:
        replacement = MegaBlocksMoE(block, adapter, len(blocks), group, dtype)
        parent_path, _, name = path.rpartition(".")
        setattr(model.get_submodule(parent_path) if parent_path else model, name, replacement)
        ignore += replacement.expert_parameter_names(path)
    if group is not None and torch.distributed.get_world_size(group) > 1:
        model._ddp_params_and_buffers_to_ignore = ignore
    return model
