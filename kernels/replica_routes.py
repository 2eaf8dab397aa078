"""The load-aware replica rule's per-expert half (`occult_hf.replicas.routing.expert_routes`) as ONE Triton kernel.

Shape legend: see `occult_hf.replicas.routing` (G ranks of the group).

`expert_routes` is hundreds of small operators on `[E, M]` tensors (the split's 2 x `SPLIT_ROUNDS` damped
water-filling rounds, then the per-expert tables), serial kernels even replayed from a CUDA graph. Here one
program holds the whole `[E, M]` problem in registers (E <= 256 and M <= 8 make at most 2048 entries) and runs
every round in place: one launch, a few microseconds of arithmetic.

Same arithmetic as the torch version, in fp64 where it uses fp64, with the same formulas (water-filling level as
`_fill` computes it, `lerp` at the step of `split_steps` as PyTorch evaluates it: `end - (end - start) * 0.5` at
one half, exact in its product, `start + step * (end - start)` below, the cumulative fractions summed home by home
as `cumsum` does) and `enable_fp_fusion=False`, so a product is rounded before the sum that uses it, as in PyTorch.
Only the order of the per-device and per-expert sums differs (Triton's fixed reduction tree against PyTorch's),
which moves the shares by a few ulps, not the integers: the counts, `offset`, and the per-expert integer sums are
exact in any order. The tree is fixed, so every rank computes the same bits from the same gathered integers. The
torch version stays the reference and the CPU path; on CPU tensors this runs under `TRITON_INTERPRET=1` (the
tests).

Under `torch.compile`, `FusedRoutes` calls the custom operator `occult::expert_routes` (this kernel where Triton runs
and the shapes fit, else `expert_routes` eagerly: the CUDA graph of `GraphedRoutes` is for eager calls); its five
tables have the shapes of the home table `[E, M]` and its experts `[E]`.
"""

from __future__ import annotations

import functools

import torch

from occult_hf.replicas.routing import SPLIT_ROUNDS, GraphedRoutes, expert_routes

from .triton_support import interpreting, next_power_of_2, require_triton, triton_runs_on

#: the most homes of one expert and the most experts one program holds (registers: BLOCK_E x BLOCK_M entries)
MAX_HOMES, MAX_EXPERTS = 8, 256
#: the most `[E, M, D-block]` entries one device-load step holds at once (the devices are taken in blocks)
MAX_ONEHOT = 16384


def unfused_options(interpret: bool, num_warps: int) -> dict:
    """Launch options of the replica rule's kernels (here and `kernels.replica_pairs`): no fused multiply-adds, so a
    product is rounded before the sum that uses it, as in PyTorch (none under the interpreter, which compiles
    nothing)."""
    return {} if interpret else {"enable_fp_fusion": False, "num_warps": num_warps}


@functools.lru_cache(maxsize=2)
def _kernel(interpret: bool):
    """The kernel, made on first use (one per mode: `triton.jit` decides at decoration whether it is interpreted).
    Only Triton builtins: `tl.sum`, `tl.max` and `tl.zeros` are jit functions, which the interpreter cannot run after
    Triton was imported without it (nor a jit helper made here: it reads the module's globals, not closures), so the
    sums are `tl.reduce` with `tl.sum`'s own combine function, the same reduction tree."""
    triton = require_triton("the load-aware replica rule's kernel (occult_hf.kernels.replica_routes)")
    import triton.language as tl

    @triton.jit
    def expert_routes_kernel(
        counts_ptr, table_ptr, slack_ptr, shares_ptr, stay_ptr, offset_ptr, rest_before_ptr, rest_total_ptr, cumulative_ptr,
        num_ranks, rank, num_experts, num_homes, num_devices,
        PINNED: tl.constexpr, ROUNDS: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr,
    ):  # fmt: skip
        e_E = tl.arange(0, BLOCK_E)
        m_M = tl.arange(0, BLOCK_M)
        in_EM = (e_E[:, None] < num_experts) & (m_M[None, :] < num_homes)
        home_EM = tl.load(table_ptr + e_E[:, None] * num_homes + m_M[None, :], mask=in_EM, other=-1)
        # the group's counts and those of the ranks before this one (integers: exact in any order)
        row = num_homes + 1
        visited_EM = tl.full([BLOCK_E, BLOCK_M], 0, tl.int64)
        before_EM = tl.full([BLOCK_E, BLOCK_M], 0, tl.int64)
        none_E = tl.full([BLOCK_E], 0, tl.int64)
        before_none_E = tl.full([BLOCK_E], 0, tl.int64)
        for g in range(num_ranks):
            base = counts_ptr + g * num_experts * row
            part_EM = tl.load(base + e_E[:, None] * row + m_M[None, :], mask=in_EM, other=0)
            part_E = tl.load(base + e_E * row + num_homes, mask=e_E < num_experts, other=0)
            visited_EM += part_EM
            none_E += part_E
            before_EM += tl.where(g < rank, part_EM, 0)
            before_none_E += tl.where(g < rank, part_E, 0)
        visits_EM = visited_EM.to(tl.float64)
        total_E = tl.reduce(visits_EM, 1, tl.standard._sum_combine) + none_E.to(tl.float64)
        # replica_shares: single-home experts serve at home; the replicated ones are split in the rounds
        valid_EM = home_EM >= 0
        homes_E = tl.reduce(valid_EM.to(tl.int32), 1, tl.standard._sum_combine)
        on_EM = valid_EM & (homes_E[:, None] > 1)
        off_EM = tl.where(on_EM, 0.0, float("inf")).to(tl.float64)
        single_E = tl.where(homes_E > 1, 0.0, total_E)
        first_E = tl.reduce(tl.where(m_M[None, :] == 0, home_EM, 0), 1, tl.standard._sum_combine)
        shares_EM = tl.where(on_EM, total_E[:, None] / tl.maximum(homes_E, 1)[:, None].to(tl.float64), 0.0)
        slack_total = tl.load(slack_ptr) * tl.reduce(total_E, 0, tl.standard._sum_combine) / num_devices
        cap = tl.reduce(total_E, 0, tl.standard._sum_combine) * 0.0
        # replicas.routing.split_steps: 1 / sqrt(2 n), n >= 2 the most replicated experts sharing one of its devices
        sharing_EM = tl.full([BLOCK_E, BLOCK_M], 0.0, tl.float64)
        for d0 in range(0, num_devices, BLOCK_D):
            d_D = d0 + tl.arange(0, BLOCK_D)
            on_EMD = (home_EM[:, :, None] == d_D[None, None, :]) & on_EM[:, :, None]
            sharing_D = tl.reduce(tl.reduce(on_EMD.to(tl.float64), 0, tl.standard._sum_combine), 0, tl.standard._sum_combine)
            sharing_EM += tl.reduce(tl.where(on_EMD, sharing_D[None, None, :], 0.0), 2, tl.standard._sum_combine)
        step_E = 1.0 / tl.sqrt(2.0 * tl.maximum(tl.reduce(sharing_EM, 1, tl.standard._elementwise_max), 2.0))
        for r in range(2 * ROUNDS):
            # every device's load, read back at each home (devices in blocks of BLOCK_D), and the largest
            at_home_EM = tl.full([BLOCK_E, BLOCK_M], 0.0, tl.float64)
            top = cap * 0.0 - float("inf")
            for d0 in range(0, num_devices, BLOCK_D):
                d_D = d0 + tl.arange(0, BLOCK_D)
                on_EMD = home_EM[:, :, None] == d_D[None, None, :]
                on_MD = tl.reduce(tl.where(on_EMD, shares_EM[:, :, None], 0.0), 0, tl.standard._sum_combine)
                load_D = tl.reduce(on_MD, 0, tl.standard._sum_combine)
                load_D += tl.reduce(tl.where(first_E[:, None] == d_D[None, :], single_E[:, None], 0.0), 0, tl.standard._sum_combine)
                top = tl.maximum(top, tl.reduce(tl.where(d_D < num_devices, load_D, -float("inf")), 0, tl.standard._elementwise_max))
                at_home_EM += tl.reduce(tl.where(on_EMD, load_D[None, None, :], 0.0), 2, tl.standard._sum_combine)
            other_EM = at_home_EM - shares_EM
            # phase 2 (from round ROUNDS): floors, the visited pairs a home keeps within the cap
            cap = tl.where(r == ROUNDS, top + slack_total, cap)
            floor_EM = tl.where(r >= ROUNDS, tl.minimum(visits_EM, tl.maximum(cap - other_EM, 0.0)), 0.0)
            # _fill: the water level is the least, over homes j, of the bound of the homes started by j
            start_EM = other_EM + floor_EM + off_EM
            excess_E = total_E + tl.reduce(tl.where(on_EM, other_EM - start_EM, 0.0), 1, tl.standard._sum_combine)
            level_E = excess_E * 0.0 + float("inf")
            for j in tl.static_range(BLOCK_M):
                start_E = tl.reduce(tl.where(m_M[None, :] == j, start_EM, 0.0), 1, tl.standard._sum_combine)
                on_E = tl.reduce(tl.where(m_M[None, :] == j, on_EM.to(tl.int32), 0), 1, tl.standard._sum_combine) > 0
                rises_EM = start_EM <= start_E[:, None]
                started_E = tl.reduce(tl.where(rises_EM, start_EM, 0.0), 1, tl.standard._sum_combine)
                risen_E = tl.reduce(rises_EM.to(tl.int32), 1, tl.standard._sum_combine).to(tl.float64)
                level_E = tl.where(on_E, tl.minimum(level_E, (excess_E + started_E) / risen_E), level_E)
            fill_EM = tl.where(on_EM, tl.maximum(start_EM, level_E[:, None]) - other_EM, 0.0)
            # torch.lerp(shares, fill, step) as PyTorch evaluates it (a step is at most one half)
            step_EM = step_E[:, None] + shares_EM * 0.0
            shares_EM = tl.where(
                step_EM < 0.5, shares_EM + step_EM * (fill_EM - shares_EM), fill_EM - (fill_EM - shares_EM) * (1.0 - step_EM)
            )
        shares_EM = tl.where(on_EM, shares_EM, tl.where(m_M[None, :] == 0, single_E[:, None], 0.0))
        # expert_routes' tables
        if PINNED:
            keep_EM = visits_EM
        else:
            keep_EM = tl.minimum(visits_EM, shares_EM)
        stay_EM = tl.where(visits_EM > 0, keep_EM / tl.maximum(visits_EM, 1.0), 1.0)
        before_visits_EM = before_EM.to(tl.float64)
        moved_before_E = tl.reduce(before_visits_EM - tl.floor(before_visits_EM * stay_EM + 0.5), 1, tl.standard._sum_combine)
        moved_E = tl.reduce(visits_EM - tl.floor(visits_EM * stay_EM + 0.5), 1, tl.standard._sum_combine)
        pool_EM = tl.maximum(shares_EM - keep_EM, 0.0)
        pool_EM = tl.where(in_EM, pool_EM, 0.0)
        pool_E = tl.reduce(pool_EM, 1, tl.standard._sum_combine)
        pool_EM = tl.where(pool_E[:, None] > 0, pool_EM, tl.where(in_EM, shares_EM, 0.0))
        pool_E = tl.reduce(pool_EM, 1, tl.standard._sum_combine)
        running_E = pool_E * 0.0
        cumulative_EM = tl.full([BLOCK_E, BLOCK_M], 0.0, tl.float64)
        for j in tl.static_range(BLOCK_M):  # home by home, as cumsum adds
            running_E += tl.reduce(tl.where(m_M[None, :] == j, pool_EM, 0.0), 1, tl.standard._sum_combine)
            cumulative_EM = tl.where(m_M[None, :] == j, running_E[:, None], cumulative_EM)
        cumulative_EM = cumulative_EM / tl.maximum(pool_E, 1e-300)[:, None]
        out_EM = e_E[:, None] * num_homes + m_M[None, :]
        tl.store(shares_ptr + out_EM, shares_EM, mask=in_EM)
        tl.store(stay_ptr + out_EM, stay_EM, mask=in_EM)
        tl.store(offset_ptr + out_EM, before_EM, mask=in_EM)
        tl.store(cumulative_ptr + out_EM, cumulative_EM, mask=in_EM)
        tl.store(rest_before_ptr + e_E, before_none_E + moved_before_E.to(tl.int64), mask=e_E < num_experts)
        tl.store(rest_total_ptr + e_E, none_E + moved_E.to(tl.int64), mask=e_E < num_experts)

    return expert_routes_kernel


def fused_expert_routes(
    all_GEM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, rank: int, pin_slack: float, pinned: bool
) -> tuple[torch.Tensor, ...]:
    """`replicas.routing.expert_routes` in one launch: same arguments, same five tables (contiguous)."""
    return fused_routes_and_shares(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned)[0]


def fused_routes_and_shares(
    all_GEM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, rank: int, pin_slack: float, pinned: bool
) -> tuple[tuple[torch.Tensor, ...], torch.Tensor]:
    """`(tables, shares_EM)`: `fused_expert_routes`' tables and the split they come from (`replica_shares` of the
    summed counts, `[E, M]` float64; the kernel writes it anyway, and it is what the tests hold to the torch split)."""
    num_ranks, num_experts, row = all_GEM1.shape
    num_homes = home_table_EM.shape[1]
    if row != num_homes + 1 or home_table_EM.shape[0] != num_experts:
        raise ValueError(
            f"fused_expert_routes: counts {list(all_GEM1.shape)} must be [G, E, M + 1] for the [E, M] home table "
            f"{list(home_table_EM.shape)}"
        )
    if num_experts > MAX_EXPERTS or num_homes > MAX_HOMES:
        raise ValueError(
            f"fused_expert_routes holds at most E={MAX_EXPERTS} experts and M={MAX_HOMES} homes in one program, "
            f"got E={num_experts}, M={num_homes}"
        )
    if not 0 <= rank < num_ranks:
        raise ValueError(f"fused_expert_routes: rank must be in [0, {num_ranks}) (the gathered ranks), got {rank}")
    device = all_GEM1.device
    block_e, block_m = next_power_of_2(num_experts), next_power_of_2(num_homes)
    block_d = min(next_power_of_2(num_devices), max(MAX_ONEHOT // (block_e * block_m), 1))
    shares_EM = torch.empty(num_experts, num_homes, dtype=torch.float64, device=device)
    stay_EM, cumulative_EM = torch.empty_like(shares_EM), torch.empty_like(shares_EM)
    offset_EM = torch.empty(num_experts, num_homes, dtype=torch.int64, device=device)
    rest_before_E = torch.empty(num_experts, dtype=torch.int64, device=device)
    rest_total_E = torch.empty_like(rest_before_E)
    slack = torch.full((1,), float(pin_slack), dtype=torch.float64, device=device)
    interpret = interpreting()
    options = unfused_options(interpret, num_warps=8 if block_e * block_m > 512 else 4)
    _kernel(interpret)[(1,)](
        all_GEM1.long().contiguous(), home_table_EM.long().contiguous(), slack, shares_EM, stay_EM, offset_EM,
        rest_before_E, rest_total_E, cumulative_EM, num_ranks, rank, num_experts, num_homes, num_devices,
        PINNED=bool(pinned), ROUNDS=SPLIT_ROUNDS, BLOCK_E=block_e, BLOCK_M=block_m, BLOCK_D=block_d, **options,
    )  # fmt: skip
    return (stay_EM, offset_EM, rest_before_E, rest_total_E, cumulative_EM), shares_EM


class FusedRoutes:
    """The per-expert half as a dispatcher runs it (one instance per layer): this kernel on a GPU with Triton and
    shapes it holds, else `GraphedRoutes` (a CUDA graph on a GPU, eager on CPU). A Triton launch is also
    captured by an enclosing CUDA graph (graphed decoding), so no case needs the graph when the kernel runs.
    Under `torch.compile`, the operator `occult::expert_routes`."""

    def __init__(self) -> None:
        self._graphed = GraphedRoutes()

    def __call__(
        self, all_GEM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, rank: int, pin_slack: float, pinned: bool
    ) -> tuple[torch.Tensor, ...]:
        if torch.compiler.is_compiling():
            return torch.ops.occult.expert_routes(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned)
        if _kernel_applies(all_GEM1, home_table_EM):
            return fused_expert_routes(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned)
        return self._graphed(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned)


def _kernel_applies(all_GEM1: torch.Tensor, home_table_EM: torch.Tensor) -> bool:
    """Whether the kernel runs here (Triton on these tensors) and holds the shapes (`MAX_EXPERTS`, `MAX_HOMES`)."""
    num_experts, num_homes = home_table_EM.shape
    return triton_runs_on(all_GEM1) and num_experts <= MAX_EXPERTS and num_homes <= MAX_HOMES


@torch.library.custom_op("occult::expert_routes", mutates_args=())
def _expert_routes_op(
    all_GEM1: torch.Tensor, home_table_EM: torch.Tensor, num_devices: int, rank: int, pin_slack: float, pinned: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`expert_routes`' five tables as one operator: the kernel where `_kernel_applies`, else the torch version."""
    if _kernel_applies(all_GEM1, home_table_EM):
        return fused_expert_routes(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned)
    tables = expert_routes(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned)
    return tuple(table.contiguous() for table in tables)  # one table is a view of a sum: the kernel's are dense


@_expert_routes_op.register_fake
def _(all_GEM1, home_table_EM, num_devices, rank, pin_slack, pinned):
    num_experts, num_homes = home_table_EM.shape
    fraction_EM = all_GEM1.new_empty(num_experts, num_homes, dtype=torch.float64)
    count_E = all_GEM1.new_empty(num_experts, dtype=torch.int64)
    return fraction_EM, all_GEM1.new_empty(num_experts, num_homes, dtype=torch.int64), count_E, torch.empty_like(count_E), torch.empty_like(fraction_EM)


__all__ = ["MAX_EXPERTS", "MAX_HOMES", "FusedRoutes", "fused_expert_routes", "fused_routes_and_shares", "unfused_options"]
