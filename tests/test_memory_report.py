"""`odeckpt.memory_report` and `odeckpt.compiled_memory` read XLA's compiled memory analysis."""

import doctest

import equinox as eqx
import jax
import jax.numpy as jnp
import pytest

import odeckpt
import odeckpt._memory
from odeckpt.checkpointing import checkpointed_scan

WIDTH = 256


def scan_loss(xs, scan=jax.lax.scan, **kwargs):
    z = jnp.ones(WIDTH)

    def step(y, x):
        return y + x * jnp.sin(y + z), None

    return scan(step, jnp.zeros(WIDTH), xs, **kwargs)[0].sum()


def test_matches_memory_analysis():
    xs = jnp.ones(20)
    report = odeckpt.memory_report(scan_loss, xs)
    expected = jax.jit(jax.grad(scan_loss)).lower(xs).compile().memory_analysis()
    assert report.gradient.temp == expected.temp_size_in_bytes
    assert report.gradient.argument == expected.argument_size_in_bytes == 20 * 8
    assert report.function.output == 8  # a float64 scalar
    assert report.gradient.total >= report.gradient.temp + report.gradient.argument


def test_gradient_memory_grows_with_lax_scan_not_with_checkpointed_scan():
    # One stored residual per step for lax.scan; two snapshots whatever the length otherwise.
    state = WIDTH * 8
    plain = [odeckpt.memory_report(scan_loss, jnp.ones(n)).gradient.temp for n in (20, 40)]
    assert plain[1] - plain[0] >= 20 * state
    two = [
        odeckpt.compiled_memory(
            jax.grad(lambda xs: scan_loss(xs, checkpointed_scan, checkpoints=2)), jnp.ones(n)
        ).temp
        for n in (20, 40)
    ]
    assert two[1] - two[0] < state


def test_equinox_modules_and_static_arguments():
    mlp = eqx.nn.MLP(4, 1, 32, 2, key=jax.random.key(0))

    def loss(model, x, scale):
        return scale * jnp.sum(model(x))

    report = odeckpt.memory_report(loss, mlp, jnp.ones(4), 2.0)
    weights = sum(leaf.nbytes for leaf in jax.tree.leaves(eqx.filter(mlp, eqx.is_array)))
    # The gradient returns one cotangent per weight of the first argument (plus alignment).
    assert weights <= report.gradient.output < weights + 1024
    assert weights <= report.function.argument < weights + 1024


def test_fits_and_printed_table():
    report = odeckpt.memory_report(scan_loss, jnp.ones(10))
    assert report.fits("1GB") and not report.fits(report.gradient.total - 1)
    lines = str(report).splitlines()
    assert lines[0].split() == ["function", "gradient"]
    assert [line.split()[0] for line in lines[1:]] == [
        "temp",
        "argument",
        "output",
        "generated_code",
        "total",
    ]


def test_non_scalar_output_raises_with_the_fix():
    with pytest.raises(ValueError, match="must return a scalar.*Fix"):
        odeckpt.memory_report(jnp.sin, jnp.ones(3))


def test_docstring_examples():
    result = doctest.testmod(odeckpt._memory, raise_on_error=False, verbose=False)
    assert result.failed == 0 and result.attempted > 0, result
