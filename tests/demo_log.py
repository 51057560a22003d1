"""What a run of the demo (examples/pretrain_gpt.py) logged, read back by iteration: the values it
computed, from its own "exact values" line (every digit), and what Megatron's line printed
(rounded: the loss to 7 digits, the grad norm to 3), as printed."""

import re

import torch

# "[date time] iteration        3/      25 | ... | lm loss: 6.720000E+00 | ... | grad norm: 0.695 |"
MEGATRON_LINE = re.compile(r' iteration\s+(\d+)/\s*\d+ \|(.*)$', re.MULTILINE)
# " iteration        3 | exact values | lm loss: 6.719984531402588 | grad norm: 0.69512 |".
# Not anchored at the line's start: under torchrun another rank's output may precede it there.
EXACT_LINE = re.compile(r' iteration\s+(\d+) \| exact values \|(.*)$', re.MULTILINE)


def _fields(line: re.Pattern, log: str) -> dict[int, dict[str, str]]:
    """Each matching line's "key: value" fields, by iteration."""
    lines = {}
    for iteration, rest in line.findall(log):
        fields = (part.strip().partition(': ') for part in rest.split('|'))
        lines[int(iteration)] = {key: value for key, colon, value in fields if colon}
    return lines


def exact_values(log: str, key: str) -> dict[int, float]:
    """The run's own values of `key` ('lm loss', 'grad norm', 'max attention logit')."""
    return {i: float(fields[key]) for i, fields in _fields(EXACT_LINE, log).items() if key in fields}


def printed_values(log: str, key: str) -> dict[int, str]:
    """What Megatron's iteration line printed for `key` ('lm loss', 'grad norm'), as printed."""
    return {i: fields[key] for i, fields in _fields(MEGATRON_LINE, log).items() if key in fields}


def losses(log: str, first: int, last: int) -> list[float]:
    """The exact losses of iterations first..last, which the log must hold, and only those;
    checked against what Megatron's line printed."""
    values = exact_values(log, 'lm loss')
    assert sorted(values) == list(range(first, last + 1)), (sorted(values), log[-3000:])
    assert_megatron_printed(log, values, exact_values(log, 'grad norm'))
    return [values[i] for i in range(first, last + 1)]


def assert_megatron_printed(log: str, losses: dict, grad_norms: dict) -> None:
    """Megatron's line shows these values rounded: the grad norm to 3 decimals, the loss to 7
    digits; but the loss of a run's second iteration, which is the mean of its first two
    (training_log keeps its fp32 loss sum over a run's first iteration, in any run)."""
    printed_losses, printed_norms = printed_values(log, 'lm loss'), printed_values(log, 'grad norm')
    second = min(losses) + 1
    for i, loss in losses.items():
        if i == second:
            loss = (torch.tensor([losses[i - 1]]) + torch.tensor([loss])).item() / 2
        assert printed_losses[i] == f'{loss:.6E}', (i, printed_losses[i], loss)
        assert printed_norms[i] == f'{grad_norms[i]:.3f}', (i, printed_norms[i], grad_norms[i])
