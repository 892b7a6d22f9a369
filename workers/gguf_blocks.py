"""A GGUF file's quantized matrices as block forms (`pagedserve_kernels.gguf_panels.BlockForm`), so
layers can keep the codes the file stores for the int8-activation kernel (`quantized_activations`)
instead of recovering them from dequantized float32 values, which only works for Q4_1 / Q8_0.

Invariant: `GgufBlockSource.form(name, ...)` dequantizes, bit for bit, to the rows or columns
the dequantized cache (`workers.gguf_weights.dequantized_tensors`) holds for `name`: the same
HF names, the same Q/K row order (llama.cpp's permutation undone on the codes, scales and
minimums alike), the same slices.
"""

from __future__ import annotations

from pagedserve_kernels.gguf_panels import BlockForm, form_from_gguf, has_panel_form
from workers.config import ModelSpec
from workers.families import family_named
from workers.gguf_header import GgufHeader, HeaderTensor
from workers.gguf_weights import hf_name, unpermute_rows


class GgufBlockSource:
    """HF weight name -> its GGUF tensor's block form, decoded on each request (a layer asks
    once per tensor at load)."""

    def __init__(self, reader: GgufHeader, spec: ModelSpec) -> None:
        family = family_named(str(reader.fields["general.architecture"].contents()))
        self._tensors: dict[str, HeaderTensor] = {}
        self._heads: dict[str, int] = {}
        for tensor in reader.tensors:
            name = hf_name(tensor.name, family)
            if name is None or ".*." in name or len(tensor.shape) != 2:
                continue
            if not has_panel_form(tensor.tensor_type):
                continue
            self._tensors[name] = tensor
            if family.gguf_qk_permuted and tensor.name.endswith("attn_q.weight"):
                self._heads[name] = spec.num_heads
            elif family.gguf_qk_permuted and tensor.name.endswith("attn_k.weight"):
                self._heads[name] = spec.num_kv_heads

    def names(self) -> set[str]:
        return set(self._tensors)

    def form(self, name: str, dim: int, start: int, stop: int | None) -> BlockForm | None:
        """Rows (`dim=0`) or columns (`dim=1`) `[start, stop)` of weight `name` as stored in
        the file, or None where it is not stored in a format with a panel form or the columns
        do not fall on whole blocks of 32."""
        tensor = self._tensors.get(name)
        if tensor is None:
            return None
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))  # GGUF lists ne0 (columns) first
        form = form_from_gguf(tensor.tensor_type, tensor.data, shape)
        heads = self._heads.get(name)
        if heads is not None:
            codes, scales, mins = (
                unpermute_rows(t, heads) for t in (form.codes, form.scales, form.mins)
            )
            form = BlockForm(codes.contiguous(), scales.contiguous(), mins.contiguous(), form.bits)
        stop = shape[dim] if stop is None else stop
        return form.rows(start, stop) if dim == 0 else form.columns(start, stop)
