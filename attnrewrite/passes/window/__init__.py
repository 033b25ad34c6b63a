"""The window hybrid (``window=W`` of linear, favor and hedgehog): exact softmax over each query's
block of W positions, the previous block, the next one (bidirectional, ``window_next``) and the
first ``sinks`` positions, the kernel over the other keys, one shared normaliser. Its blocks
decide which keys are exact, so both lowerings lay them out alike.

- settings.py: Window (the three settings, declared and checked once as option fields), how
  the kernel part is weighed (KernelUnit, KernelScales), the exact part;
- reference.py: the definition as an N x N matrix (fitting losses, and what tests compare with);
- blocks.py: the torch forms' block and pair layouts;
- torch_form.py: the hybrid in torch (the FX lowering and what calibration fits);
- lowering.py: the ONNX entry a method calls (windowed_kernel), built from onnx_blocks.py
  (the blocks' layout and per-row pieces), onnx_pairs.py (bidirectional) and onnx_causal.py;
- torch_state.py, onnx_state.py: the causal hybrid continued from a state (decoders).
- sparse_cache.py: a causal window's sparse exact cache (``sparse=G``): the pairs beyond the
  window the kernel state recalls worst, kept exactly; block by block, from no state or a
  decoder's (its definition, and reference.sparse_cached_keys its plain simulation);
  onnx_sparse.py its ONNX twin (one Loop over the blocks, parallel and from a state).

A bidirectional window keeps no state per block and copies no block: one state for the whole
sequence, [S, z] = sum_j phi_k_j [v_j, 1]^T (keys that are not kept: [v_j, 1] = 0), and the
kernel terms of each query's exact keys (local, and the sinks it takes) taken back out inside
the exact part's weights, one product with their values:
    sums_i = sum_exact (e^(s_ij - shift_i) - b_i phi_q_i.phi_k_j) [v_j, 1] + b_i phi_q_i.[S, z]
(shift_i the row's max exact logit plus the part of the two units' log ratio that scales the
exact part, b_i the kernel part's share; the last column is the denominator). The local keys are
laid out in pairs of blocks, a reshape of the rows (q and k are padded into them before the
feature maps, lowering.window_inputs_function), and each block's neighbour outside its pair, one
gather of whole blocks (onnx_pairs.py's docstring). What is left after the subtraction keeps the
rounding of the whole sum, so row i's output moves by up to about
    eps32 * sum_{j exact} K_ij |v_j| / D_i
beyond a per-block state's (K_ij the kernel weight in the output's units, D_i the row's
normaliser): small where a kernel is in the exact part's units (fitted hedgehog, favor: on
MiniLM's q, k, v at N = 256..4096 every form is within 2e-6 of the float64 definition,
bench/window_rounding.md), large only where unit-free local kernel terms outweigh the exact part
and a row has almost no far key (N near 3W). A block without any far block gives exactly 0 far
part (b_i = 0). Superblock states (exact, no cancellation) cost a [W, 3P] masked kernel-score
block per query block for superblocks of P positions: several times the work, for no rounding
gain measurable on MiniLM. The torch form (calibration's forward and backward) lays the exact part
out alike but, up to STATE_BLOCKS blocks, sums the far part from per-block states instead: at a
few hundred positions that is the faster form, and nothing cancels.

A causal window's exact part takes the same pairs of blocks and one gather (in a pair's lower
triangle, each block's own keys up to the query and, for the pair's first block, the block before
it; onnx_causal.py). Its far part (blocks <= c-2) keeps no state per block: it is a chunked
causal kernel over chunks of P blocks (P W ~ WINDOW_FAR_CHUNK positions, whatever W), with the
keys one block behind the queries, so that every earlier key chunk is wholly far (one exclusive
prefix of per-chunk states) and inside a chunk a block-strictly-lower mask on the kernel scores
takes exactly the far keys (the comment above onnx_causal._chunked_far_sums_functions; the torch
form, blocks.FarChunks, lays its chunks out alike). No local key enters the far sums, so nothing
cancels: they round as sums of far terms.

Modules here import each other's public names only, and nothing above passes/window/ but the
kernel family (passes/kernel/) and the passes' shared pieces.
"""

from attnrewrite.passes.window.settings import KernelScales, KernelUnit, Window

__all__ = ["KernelScales", "KernelUnit", "Window"]
