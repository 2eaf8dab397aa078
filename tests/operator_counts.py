"""Counting the aten calls of a profiled step that launch work: what an operator budget test reads."""

from __future__ import annotations

#: aten calls that launch no kernel (views and allocations), unless `copies` says they copied
NOT_LAUNCHES = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::as_strided", "aten::slice", "aten::select", "aten::t",
    "aten::transpose", "aten::expand", "aten::unsqueeze", "aten::squeeze", "aten::detach", "aten::alias", "aten::permute",
    "aten::unbind", "aten::split", "aten::narrow", "aten::lift_fresh", "aten::_unsafe_view", "aten::view_as",
    "aten::contiguous", "aten::empty_like", "aten::empty", "aten::empty_strided", "aten::result_type", "aten::resolve_conj",
    "aten::resolve_neg",
}  # fmt: skip


def copies(event) -> bool:
    """Whether a view-like call (`reshape`, `contiguous`) copied its input after all (a kernel then)."""
    return any(child.name in ("aten::copy_", "aten::clone") or copies(child) for child in event.cpu_children)


def under_aten(event) -> bool:
    parent = event.cpu_parent
    while parent is not None:
        if parent.name.startswith("aten::"):
            return True
        parent = parent.cpu_parent
    return False
