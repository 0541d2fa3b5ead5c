"""Test helpers: a symmetric INT4 weight as prepared before the kernels took 8 for its zero points, so that tests can
check that dropping a stream leaves every bit as it was (test_kernels_cpu, test_amx)."""
import dataclasses

import kernels.cpu as cpu


def with_zero_stream(p):
    """A symmetric INT4 r16 weight with its scale·zero products as a stream (block_sz)."""
    w = dataclasses.replace(p.orig, block_sz=cpu._block_groups(p.orig.scale * p.orig.zero))
    return cpu.Packed(w, cpu._pack(w))


def with_zero_points(p):
    """A symmetric row-major INT4 weight with its zero points passed to the kernels."""
    return cpu.Packed(p.orig, p.args[:5] + (p.orig.zero.float().contiguous(),) + p.args[6:])


def with_float_scales(p):
    """An INT4 r16 weight whose bfloat16 block scales (exact) are float32 again, as prepare stored them before."""
    w = dataclasses.replace(p.orig, block_scale=p.orig.block_scale.float())
    return cpu.Packed(w, cpu._pack(w))
