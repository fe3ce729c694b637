"""The Mosaic GPU backend of Pallas behind one small module (the Hopper path).

Counterpart of :mod:`pallas_kernels._triton`: kernel files import their
backend-specific pieces from here — compiler parameters, shared-memory tile
transforms, row/column broadcasts in the WGMMA register layout, the interpret
switch — so the kernels read as plain tile math.

Mosaic GPU exposes what the Triton lowering hides on Hopper: explicit ``wgmma``
(INT8 × INT8 → INT32 included), TMA copies and warp specialisation (one memory
warpgroup feeding two compute warpgroups). INT8 ``wgmma`` needs both operands
K-major (the contraction dim contiguous): the ``B`` operand is always a
transposed view of a tile stored with the contraction dim last.

Beside it, each in its own module: the ``wgmma`` A operands from registers and the INT8 relayout jax 0.11.2 lacks
for them (:mod:`pallas_kernels.register_operands`), the reductions across a warpgroup's registers
(:mod:`pallas_kernels.warp_reduce`), and the fused backwards' float32 dQ accumulation by TMA reduce-add
(:mod:`pallas_kernels.reduce_add`; its stage's layout: :mod:`pallas_kernels.dq_stage`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

#: Registers left to the memory (TMA-issuing) warpgroup; the compute ones get the rest.
MEMORY_REGISTERS = 40


def compiler_params(*, manual_barriers: bool = False) -> plgpu.CompilerParams:
    """Mosaic GPU compiler parameters (fast approximate exp2/reciprocal).

    ``manual_barriers``: Pallas inserts no warpgroup barriers of its own (``unsafe_no_auto_barriers``): without it
    every store of a register tile to SMEM is ``bar.sync``, store, ``bar.sync``, and every GMEM → SMEM copy starts
    with one. A kernel that asks for this places the barriers its SMEM reuse needs itself (:func:`warpgroup_barrier`
    before overwriting a tile that other warps' ``wgmma`` read; :func:`plgpu.commit_smem` after writing one)."""
    return plgpu.CompilerParams(approx_math=True, unsafe_no_auto_barriers=manual_barriers)


def interpret_params(interpret: bool):
    """``interpret=`` argument of ``plgpu.kernel``: the Mosaic GPU interpreter on the CPU."""
    return plgpu.InterpretGPUParams() if interpret else None


def tile_transforms(dtype, cols: int) -> tuple:
    """SMEM tiling + swizzle for a 2-D tile whose rows hold ``cols`` elements of ``dtype``.

    The swizzle is the row's byte width capped at 128 (what ``wgmma`` and TMA
    both accept); the tiling is 8 rows × one swizzle width of elements.
    """
    width = cols * jnp.dtype(dtype).itemsize
    swizzle = min(128, width)
    if swizzle not in (32, 64, 128):
        raise ValueError(f"a {cols}-column {jnp.dtype(dtype).name} tile has no valid swizzle (row of {width} bytes)")
    return (plgpu.TilingTransform((8, swizzle // jnp.dtype(dtype).itemsize)), plgpu.SwizzleTransform(swizzle))


def rows_of(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcast a per-row vector (length shape[0]) over a tile."""
    return lax.broadcast_in_dim(vec, shape, [0])


def cols_of(vec: jax.Array, shape: tuple[int, int]) -> jax.Array:
    """Broadcast a per-column vector (length shape[1]) over a tile."""
    return lax.broadcast_in_dim(vec, shape, [1])


def row_vector(ref) -> jax.Array:
    """Load a 1-D SMEM vector laid out along the rows of a WGMMA tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(1))


def col_vector(ref) -> jax.Array:
    """Load a 1-D SMEM vector laid out along the columns of a WGMMA tile."""
    return plgpu.load(ref, layout=plgpu.Layout.WGMMA.reduce(0))


def warpgroup_barrier(interpret: bool) -> None:
    """Wait until every thread of this warpgroup arrives (``bar.sync`` on the warpgroup's named barrier):
    SMEM written by the warpgroup is then visible to its own loads, and every warp is past what it did before.
    Unlike ``plgpu.commit_smem`` there is no async-proxy fence (SASS ``MEMBAR.ALL.CTA`` + ``FENCE.VIEW.ASYNC.S``),
    which only TMA and ``wgmma`` readers need. The interpreter, which has no inline Mosaic GPU, commits instead."""
    if interpret:
        plgpu.commit_smem()
        return

    from jax.experimental.mosaic.gpu import utils as mgpu_utils

    @plgpu.inline_mgpu()
    def _barrier(ctx):
        del ctx
        mgpu_utils.warpgroup_barrier()

    _barrier()


def scalar(ref) -> jax.Array:
    """The one value of a 1-D SMEM vector whose entries are all equal (a per-tile scale stored repeated per
    row): one shared-memory load every thread makes (the same address: a broadcast).

    Instead of a column-vector load and a max (8 LDS.64, 17 FMNMX and 2 SHFL per thread), which also cost
    registers: in the SageBwd dK/dV kernel, three times per step, that made fwd+bwd 4–9% slower."""
    return ref[0]


def mask_scores(scores: jax.Array, key_start, query_start, *, causal: bool, offset: int = 0,
                sk_len: int | None = None, transposed: bool = False,
                key_of_column: Callable[[jax.Array], jax.Array] | None = None) -> jax.Array:
    """−inf where the key is padding (≥ ``sk_len``, if given) or, if ``causal``, key > query +
    ``offset`` (bottom-right aligned); a (queries × keys) WGMMA tile, or (keys × queries) if
    ``transposed``. ``key_start``/``query_start``: the tile's first key and query;
    ``key_of_column``: the key offset stored at each key index of the tile, if the keys are stored
    permuted within it (``lane_groups.key_of_column``).

    A tile whose every key is visible to its first query (below the causal diagonal, before the
    padded tail) is returned as is, through a branch: on a causal sequence most tiles are such,
    and they skip the iota, compare and select per element."""
    key_dim, query_dim = (0, 1) if transposed else (1, 0)

    def masked(s):
        iota = lambda dim: plgpu.broadcasted_iota(jnp.int32, s.shape, dim, layout=plgpu.Layout.WGMMA)  # noqa: E731
        keys = iota(key_dim)
        keys = (keys if key_of_column is None else key_of_column(keys)) + key_start
        visible = None if sk_len is None else keys < sk_len
        if causal:
            in_window = keys <= iota(query_dim) + query_start + offset
            visible = in_window if visible is None else visible & in_window
        return s if visible is None else jnp.where(visible, s, -jnp.inf)

    if sk_len is None and not causal:
        return masked(scores)
    last_key = key_start + (scores.shape[key_dim] - 1)
    all_visible = None if sk_len is None else last_key < sk_len
    if causal:
        below = last_key <= query_start + offset
        all_visible = below if all_visible is None else all_visible & below
    return lax.cond(all_visible, lambda s: s, masked, scores)


def grid_position() -> tuple:
    """(batch, head, warpgroup) of this thread on a ("heads", <blocks>, "batch") grid with axis "wg"."""
    return lax.axis_index("batch"), lax.axis_index("heads"), lax.axis_index("wg")


def query_block_keys(rows: int, sk_pad: int, block_k: int, *, sk_len: int, causal: bool, offset: int,
                     heavy_first_of: int | None = None) -> tuple:
    """For a CTA of ``rows`` query rows (grid axis "q") streaming
    ``block_k``-key tiles of a ``sk_pad``-key sequence: its first query row, how many key tiles it visits (all, or
    if causal, bottom-right aligned, up to the last one its last row sees) and whether its tiles
    need masking (causal, or padded keys). ``heavy_first_of`` (the number of query blocks):
    if causal, grid index 0 takes the last block, which sees the most keys (launched first,
    the longest CTAs do not trail the grid)."""
    block = lax.axis_index("q")
    if causal and heavy_first_of is not None:
        block = heavy_first_of - 1 - block
    start = block * rows
    n_ktiles = sk_pad // block_k
    steps = jnp.clip(lax.div(start + rows + offset + block_k - 1, block_k), 0, n_ktiles) if causal else n_ktiles
    return start, steps, causal or sk_len != sk_pad


def swap_within_blocks(x: jax.Array, axis: int, split: tuple[int, ...], what: str) -> jax.Array:
    """``x`` with the entries along ``axis`` permuted inside each block of ``prod(split)``: the block read as a
    row-major ``split`` array and its first two dims swapped (XLA: one transpose). The Mosaic kernels' key orders
    (``lane_groups``, ``key_pairs``) are such permutations; ``what`` names the order in the error."""
    axis %= x.ndim
    n, block = x.shape[axis], int(np.prod(split))
    if n % block:
        raise ValueError(f"{what} needs a multiple of {block} keys on axis {axis}, got {n}")
    shape = x.shape[:axis] + (n // block, *split) + x.shape[axis + 1:]
    perm = list(range(len(shape)))
    perm[axis + 1], perm[axis + 2] = perm[axis + 2], perm[axis + 1]
    return jnp.transpose(x.reshape(shape), perm).reshape(x.shape)


def first_query_tile(cta_keys, block_q: int, n_qtiles: int, *, causal: bool, offset: int):
    """The first query tile that sees a CTA's keys (from ``cta_keys`` on): 0, or if causal the
    tile of query ``cta_keys − offset``; earlier tiles are fully masked."""
    return jnp.clip(lax.div(cta_keys - offset, block_q), 0, n_qtiles) if causal else 0


def group_tile(i, n_tiles, first=0) -> tuple:
    """Step ``i`` of a dK/dV pipeline over ``n_tiles`` query tiles (from ``first`` on) of each query head of a GQA
    group → (head of the group, query tile)."""
    return lax.div(i, n_tiles), first + lax.rem(i, n_tiles)


def tma_rows(n: int) -> int:
    """``n`` rounded up to a multiple of 8: the sequence length of an output that a tiled TMA store
    writes (the store needs the GMEM row count a multiple of the SMEM tiling's 8 rows; rows past
    the end of the array are clipped by the TMA unit). Trim with :func:`trim_rows`."""
    return -(-n // 8) * 8


def trim_rows(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """``x`` cut to ``n`` entries along ``axis`` (no copy when it already has ``n``)."""
    return x if x.shape[axis] == n else lax.slice_in_dim(x, 0, n, axis=axis)


@dataclasses.dataclass(frozen=True)
class ForwardLaunch:
    """The static parameters every Mosaic forward launch has: ``wgs`` compute warpgroups per CTA, the pipeline's
    ``stages``, ``group`` query heads per kv head, ``block_k`` keys per step, the head dim, the real lengths, the
    causal mask (``offset`` = Sk − Sq) and ``interpret``. Each kernel's params add their own fields."""

    wgs: int
    stages: int
    group: int
    block_k: int
    head_dim: int
    sq_len: int
    sk_len: int
    causal: bool
    offset: int
    interpret: bool


class ForwardCta(NamedTuple):
    """Where a forward's compute warpgroup works: batch ``b``, query head ``h`` and its kv head ``hkv``, its first
    query row ``q_start`` and its ``rows`` (a slice), the CTA's key steps
    ``n_steps`` and whether they need masking (``masked``)."""

    b: jax.Array
    h: jax.Array
    hkv: jax.Array
    q_start: jax.Array
    rows: pl.Slice
    n_steps: jax.Array
    masked: bool


def forward_cta(p: ForwardLaunch, q_pad: int, k_pad: int, wg: jax.Array, tile: int) -> ForwardCta:
    """The :class:`ForwardCta` of warpgroup ``wg`` (``tile`` query rows each) over ``q_pad`` query and ``k_pad``
    key rows; causal, the heaviest query blocks launch first (:func:`query_block_keys`)."""
    b, h, _ = grid_position()
    cta_queries, n_steps, masked = query_block_keys(p.wgs * tile, k_pad, p.block_k, sk_len=p.sk_len, causal=p.causal,
                                                    offset=p.offset, heavy_first_of=-(-q_pad // (p.wgs * tile)))
    q_start = cta_queries + wg * tile
    return ForwardCta(b, h, lax.div(h, p.group), q_start, pl.ds(q_start, tile), n_steps, masked)


class QueryRows(NamedTuple):
    """:func:`query_ctas`: the CTAs of a forward over the query rows, and the rows each array gets."""

    ctas: int  # CTAs along the query rows
    q: int  # rows of Q (and of its per-row scales)
    o: int  # rows of O (B, rows, Hq, D)
    #: rows of the row outputs (B, Hq, rows), the LSE and QAT's m: whole CTAs, a multiple of 64 (a TMA copy needs
    #: every GMEM stride but the last a multiple of 16 bytes)
    row_outputs: int


def query_ctas(sq_pad: int, sq_len: int, cta_rows: int, interpret: bool) -> QueryRows:
    """The CTAs of a forward of ``cta_rows`` query rows per CTA over Sq_pad rows, and each array's rows.

    The last CTA may pass Sq_pad. Compiled, Q keeps Sq_pad rows: the rows past it read whatever TMA gives (the
    next head's rows, as below, or zeros past the array's end), which only those rows' outputs see. O has
    :func:`tma_rows` (Sq) rows and its stores (``o_ref.at[b, rows, h]``: the rows keep their own TMA dimension)
    are clipped. The row outputs (B, Hq, rows) get rows for whole CTAs: Mosaic GPU folds the indexed leading dims
    of ``ref.at[b, h, rows]`` into the TMA's row offset, so a store past Sq_pad is not clipped but lands in the
    next head's first rows (on the GPU the three-warpgroup forwards' gradients went wrong). The interpreter has no
    bounds: there Q (:func:`pad_rows`) and O
    get whole CTAs too. Every output is cut to Sq after (:func:`trim_rows`)."""
    n_ctas = -(-sq_pad // cta_rows)
    whole = n_ctas * cta_rows
    return QueryRows(n_ctas, q=whole if interpret else sq_pad, o=whole if interpret else tma_rows(sq_len),
                     row_outputs=whole)


def pad_rows(x: jax.Array, n: int, axis: int = 1) -> jax.Array:
    """``x`` zero-padded to ``n`` entries along ``axis`` (no copy when it already has ``n``): an input
    that a tiled TMA load reads needs :func:`tma_rows` rows."""
    if x.shape[axis] == n:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, n - x.shape[axis])
    return jnp.pad(x, widths)


def wg_tiles(wgs: int, rows: int, dtype, cols: int):
    """One (rows, cols) SMEM tile per compute warpgroup, tiled and swizzled for TMA and ``wgmma``."""
    return plgpu.SMEM((wgs, rows, cols), dtype, transforms=tile_transforms(dtype, cols))


def interpreter_threads() -> int:
    """Threads of XLA's CPU intra-op pool, on which the Mosaic GPU interpreter runs a CTA's warpgroups and their
    barrier waits: the larger of the schedulable cores and the host devices
    (``--xla_force_host_platform_device_count``)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    try:
        host_devices = len(jax.devices("cpu"))
    except RuntimeError:  # no CPU backend in this process (JAX_PLATFORMS without cpu)
        host_devices = 1
    return max(cores, host_devices)


def check_interpreter_threads(warpgroups: int, name: str) -> None:
    """Refuse to interpret a kernel of ``warpgroups`` warpgroups that the CPU pool cannot run: the interpreter
    blocks one pool thread per warpgroup waiting at a barrier, plus one for the call, so with fewer threads than
    ``warpgroups + 1`` it waits forever instead of failing."""
    need, have = warpgroups + 1, interpreter_threads()
    if have < need:
        raise RuntimeError(
            f"interpret=True: the Mosaic GPU interpreter needs {need} CPU threads for {name} ({warpgroups} "
            f"warpgroups) and this process has {have}, so it would hang; set XLA_FLAGS="
            f"--xla_force_host_platform_device_count={max(need, 8)} before jax is imported, or use the Triton "
            f"backends (the config's *_backend=\"triton\")")


def launch(kernel, out_type, scratch_types, grid, grid_names, *, name: str, compute_wgs: int, interpret: bool,
           manual_barriers: bool = False):
    """``plgpu.kernel`` with ``compute_wgs`` compute warpgroups plus the memory one (axis "wg"); ``name``
    is the kernel's name in profiles (``<name>_mosaic_gpu``; a partial would be "anonymous").
    ``manual_barriers``: as in :func:`compiler_params`. Interpreted, :func:`check_interpreter_threads` first."""
    warpgroups = compute_wgs + 1
    if interpret:
        check_interpreter_threads(warpgroups, name)
    return plgpu.kernel(kernel, out_type=out_type, scratch_types=scratch_types, grid=grid, grid_names=grid_names,
                        compiler_params=compiler_params(manual_barriers=manual_barriers),
                        num_threads=warpgroups, thread_name="wg",
                        interpret=interpret_params(interpret), kernel_name=name)


def wgmma_zeros(shape: tuple[int, int], dtype=jnp.float32) -> jax.Array:
    """A zero tile in the ``wgmma`` accumulator (WGMMA) register layout."""
    return plgpu.layout_cast(jnp.zeros(shape, dtype), plgpu.Layout.WGMMA)


def _call(hook: Callable[[], None] | None) -> None:
    """Run an optional hook (``issued=`` of the product helpers)."""
    if hook is not None:
        hook()


def matmul(acc_shape: tuple[int, int], acc_dtype, a, b, *, issued: Callable[[], None] | None = None) -> jax.Array:
    """``a @ b`` on the tensor cores (``a`` SMEM or registers, ``b`` SMEM), as a fresh array.
    ``issued`` (optional) is called after the product is issued, before waiting for it
    (:class:`PingPong`)."""

    def body(acc_ref):
        plgpu.wgmma(acc_ref, a, b)
        _call(issued)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(acc_shape, acc_dtype))


def matmul_sum(acc_shape: tuple[int, int], acc_dtype, operands: tuple, *, fused: bool,
               issued: Callable[[], None] | None = None) -> jax.Array:
    """``Σ a_i @ b_i`` over ``operands`` (one ``(a, b)`` per term), as a fresh array: ``fused`` issues every
    term into one accumulator and waits once; otherwise (the Mosaic GPU interpreter) the products are
    computed one at a time and added (same values up to accumulation order). ``issued`` as in :func:`matmul`."""
    if not fused:
        _call(issued)
        return sum(matmul(acc_shape, acc_dtype, a, b) for a, b in operands)

    def body(acc_ref):
        for a, b in operands:
            plgpu.wgmma(acc_ref, a, b)
        _call(issued)
        return acc_ref[...]

    return pl.run_scoped(body, plgpu.ACC(acc_shape, acc_dtype))


def matmuls(shapes: tuple, dtypes: tuple, operands: tuple, *, fused: bool,
            issued: Callable[[], None] | None = None) -> tuple:
    """Independent products ``a_i @ b_i`` (``operands``: one ``(a, b)`` per product).

    ``fused`` issues every ``wgmma`` group before one wait (the tensor cores run them
    back to back); otherwise one after the other, each waited. The Mosaic GPU
    interpreter only runs the second form (same values). ``issued`` as in :func:`accumulate`.
    """
    if not fused:
        _call(issued)
        return tuple(matmul(s, dt, a, b) for s, dt, (a, b) in zip(shapes, dtypes, operands))
    return accumulate(tuple(wgmma_zeros(s, dt) for s, dt in zip(shapes, dtypes)), operands, fused=True,
                      issued=issued)


def _operand_pair(operand) -> tuple:
    """A product's ``(a, b)``: as given, or from calling ``operand`` (a *late* operand, :func:`accumulate`)."""
    return operand() if callable(operand) else operand


def accumulate(accs: tuple, operands: tuple, *, fused: bool, issued: Callable[[], None] | None = None) -> tuple:
    """``acc_i + a_i @ b_i`` for each accumulator (float32 or int32 WGMMA-layout arrays).

    ``fused`` issues every product into its accumulator in place and waits once;
    otherwise (the Mosaic GPU interpreter) each product is computed into a fresh
    accumulator and added (same values up to accumulation order). ``issued`` (optional) is called after
    the products are issued, before the wait (interpreted: before them).

    An entry of ``operands`` may be a *late* operand: a callable returning ``(a, b)``, called in turn, after the
    products before it are issued, so the element-wise work that makes its operand (stored to SMEM and committed
    by the callable) runs while they occupy the tensor cores. It may only store to refs and return refs or
    values it made: nothing it computes can leave the accumulation otherwise.
    """
    if not fused:
        _call(issued)
        return tuple(acc + matmul(acc.shape, acc.dtype, *_operand_pair(op)) for acc, op in zip(accs, operands))

    def body(refs):
        for ref, op in zip(refs, operands):
            plgpu.wgmma(ref, *_operand_pair(op))
        _call(issued)

    return pl.run_state(body)(tuple(plgpu.ACC.init(acc) for acc in accs))


def product_first(first: tuple, accs: tuple, operands: tuple, use_first, *, fused: bool,
                  issued: Callable[[], None] | None = None) -> tuple:
    """``use_first(Σ a_j @ b_j)`` for the ``first`` product's terms, while the accumulations ``acc_i + a_i @ b_i``
    (as :func:`accumulate`) run: the first product is issued before them and only it is waited for before
    ``use_first`` (a ``wgmma.wait_group`` that leaves the later groups in flight), the rest after it.

    ``first``: ((rows, cols), float32, ((a, b), ...)), a fresh accumulator. ``use_first`` gets its value and may
    issue SMEM stores and TMA copies (a dQ tile reduce-added into GMEM). ``operands`` may hold late operands
    (:func:`accumulate`). Without ``fused`` (the Mosaic GPU
    interpreter) everything runs one product at a time, the first one first (same values). ``issued`` (optional)
    is called once every product is issued, before the first wait. Returns the accumulators. A kernel whose
    step waited for its dK/dV products before issuing its dQ product takes one tensor-core round trip fewer per
    step.

    Float32 first products only: with an int32 (INT8) one, the SageAttention backward's dQ came out wrong on the
    GPU (rel-L1 1.0 against the reference, and the kernel 33% slower) while the interpreter's was right; the
    cause was not found.
    """
    shape, dtype, terms = first
    if jnp.dtype(dtype) != jnp.dtype(jnp.float32):
        raise NotImplementedError(f"product_first: float32 first products only, got {jnp.dtype(dtype)}")
    if not fused:
        use_first(matmul_sum(shape, dtype, terms, fused=False, issued=issued))
        return accumulate(accs, operands, fused=False)

    def body(refs):
        first_ref, *acc_refs = refs
        for a, b in terms:
            plgpu.wgmma(first_ref, a, b)
        for ref, op in zip(acc_refs, operands):
            plgpu.wgmma(ref, *_operand_pair(op))
        _call(issued)
        use_first(plgpu.wgmma_accumulator_load(first_ref, wait_n=len(operands)))

    out = pl.run_state(body)((plgpu.ACC.init(wgmma_zeros(shape, dtype)), *(plgpu.ACC.init(acc) for acc in accs)))
    return tuple(out[1:])


class PingPong:
    """FlashAttention-3's ping-pong schedule between the two compute warpgroups of a CTA.

    One barrier with two arrivals, passed by both warpgroups in turn (as JAX's
    ``attention_mgpu`` does): each step issues its first tensor-core product(s), calls
    :meth:`sync` before waiting for them, does its element-wise work, calls :meth:`sync`
    again and issues the step's last product(s). Warpgroup 1 passes the barrier once
    before the pipeline (:meth:`start`) and warpgroup 0 once after it (:meth:`finish`),
    so one warpgroup's element-wise work runs while the other's products occupy the
    tensor cores. It orders execution only; the values are the same with or without it.
    Every step of both warpgroups must call :meth:`sync` equally often (the CTA's
    warpgroups share one pipeline length, so they do). ``enabled=False``: no-ops.
    """

    def __init__(self, barrier, wg, enabled: bool):
        self.barrier, self.wg, self.enabled = barrier, wg, enabled

    def sync(self) -> None:
        """Arrive on the schedule barrier and wait for the other warpgroup to arrive too."""
        if self.enabled:
            plgpu.barrier_arrive(self.barrier)
            plgpu.barrier_wait(self.barrier)

    def start(self) -> None:
        """Before the pipeline: warpgroup 1 passes once, so it trails warpgroup 0 by half a step."""
        if self.enabled:
            pl.when(self.wg == 1)(self.sync)

    def finish(self) -> None:
        """After the pipeline: warpgroup 0 passes once, matching warpgroup 1's extra pass."""
        if self.enabled:
            pl.when(self.wg == 0)(self.sync)

    def values(self, *xs):
        """``xs`` computed before the next barrier (``lax.optimization_barrier`` when enabled): the
        compiler must not sink element-wise work past :meth:`sync` into the other's turn."""
        return lax.optimization_barrier(xs) if self.enabled else xs


def schedule_barrier() -> plgpu.Barrier:
    """The scratch barrier of a :class:`PingPong` (two compute warpgroups arrive per phase)."""
    return plgpu.Barrier(num_arrivals=2)


def compute_pipeline(step, compute, in_specs, steps: int, *, compute_wgs: int = 2, stages: int = 2):
    """A warp-specialised pipeline: one memory warpgroup streams ``in_specs`` tiles for
    ``steps`` steps into ``stages`` SMEM buffers; ``compute_wgs`` warpgroups run
    ``step(index, *tiles, *consumed_barriers, carry) -> carry`` (each must arrive on the
    consumed barriers) inside ``compute(pipeline)`` (their prologue and epilogue)."""
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(steps,), max_concurrent_steps=stages, num_compute_wgs=compute_wgs,
        memory_registers=MEMORY_REGISTERS, wg_axis="wg", manual_consumed_barriers=True,
        compute_context=compute, in_specs=in_specs)


def needed_step(step: jax.Array, q_start: jax.Array, *, block_k: int, sq_len: int, causal: bool, offset: int,
                tile: int = 64):
    """Whether the warpgroup of query rows ``q_start``… (``tile`` of them) has any key to see in key tile ``step``
    (``block_k`` keys): its rows are not all padding and, causal (bottom-right aligned), the tile starts at or before
    its last row's diagonal (a forward without ping-pong skips the other steps: ``guarded_step``)."""
    real = q_start < sq_len
    if not causal:
        return real
    return real & (step * block_k <= q_start + (tile - 1) + offset)


def guarded_step(run, carry, consumed, *, needed=None, skipped=None):
    """One :func:`compute_pipeline` step of a compute warpgroup: ``run(carry)``, or, given ``needed`` (a traced
    bool), ``lax.cond(needed, run, skipped, carry)``, where ``skipped`` returns what ``run`` would for a step that
    leaves the carry as it is (a warpgroup skipping work that is empty for its rows). Either way the warpgroup then
    arrives on the step's consumed barriers, so the memory warpgroup's protocol is the same."""
    carry = run(carry) if needed is None else lax.cond(needed, run, skipped, carry)
    for barrier in consumed:
        plgpu.barrier_arrive(barrier)
    return carry


def key_step_specs(block: int, head_dim: int) -> list:
    """BlockSpecs of one key step's K̂ (block, D) int8 tile and its (block,) scales, step j → keys j·block…"""
    return [plgpu.BlockSpec((block, head_dim), lambda j: (j, 0), transforms=tile_transforms(jnp.int8, head_dim)),
            plgpu.BlockSpec((block,), lambda j: (j,))]


def transposed_step_spec(block: int, head_dim: int, dtype=jnp.int8):
    """BlockSpec of a (D, block) tile of a transposed (D, S) array (K̂ᵀ, V̂ᵀ), step j → columns j·block…"""
    return plgpu.BlockSpec((head_dim, block), lambda j: (0, j), transforms=tile_transforms(dtype, block))


def copy_in(copies, barriers, wg) -> None:
    """Start the TMA copies ``(src, dst)`` of this warpgroup (barrier i, wg), then wait for all."""
    for i, (src, dst) in enumerate(copies):
        plgpu.copy_gmem_to_smem(src, dst, barriers.at[i, wg])
    for i in range(len(copies)):
        plgpu.barrier_wait(barriers.at[i, wg])


def copy_out(copies) -> None:
    """Fence this warpgroup's SMEM writes, TMA-copy each ``(smem src, gmem dst)`` out as one
    group, and wait until it has read the SMEM (the counterpart of :func:`copy_in`): a later write may reuse the
    tile, and nothing in the kernel reads the GMEM back, so the writes need not land first."""
    plgpu.commit_smem()
    for src, dst in copies:
        plgpu.copy_smem_to_gmem(src, dst, commit_group=False)
    plgpu.commit_smem_to_gmem_group()
    plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def on_hopper() -> bool:
    """True when the default device is an sm_90 GPU (H100/H200), where these kernels run."""
    if jax.default_backend() not in ("gpu", "cuda"):
        return False
    return getattr(jax.devices()[0], "compute_capability", "") == "9.0"


__all__ = ["pl", "plgpu", "compiler_params", "interpret_params", "tile_transforms", "rows_of", "cols_of", "row_vector",
           "col_vector", "mask_scores", "grid_position", "query_block_keys", "swap_within_blocks",
           "first_query_tile", "tma_rows", "trim_rows", "QueryRows", "query_ctas", "pad_rows",
           "wg_tiles", "launch", "ForwardLaunch", "ForwardCta", "forward_cta", "wgmma_zeros", "matmul",
           "matmul_sum", "matmuls", "accumulate", "compute_pipeline",
           "guarded_step", "key_step_specs", "transposed_step_spec", "copy_in", "copy_out", "on_hopper",
           "MEMORY_REGISTERS", "product_first",
           "PingPong", "schedule_barrier", "group_tile"]
