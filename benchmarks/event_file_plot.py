"""A run's Muon step as TensorBoard has it, in one picture: each iteration's level-2 phases (the
max over ranks of each timer, stacked) under the whole step, and the step's scalars
(reporting.step_report), read from the event file a megatron.training or Bridge run writes
with --timing-log-level 2 --log-timers-to-tensorboard --tensorboard-dir DIR.

    python benchmarks/event_file_plot.py DIR [OUT.png]   (default benchmarks/results/event_file.png)
"""

import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator  # noqa: E402

from megatron_muon.observe.phases import timer_names  # noqa: E402
from megatron_muon.reporting.step_report import SCALARS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def main(directory: str, out: Path) -> None:
    board = EventAccumulator(directory, size_guidance={"scalars": 0})
    board.Reload()
    series = {tag: {e.step: e.value for e in board.Scalars(tag)} for tag in board.Tags()["scalars"]}
    step = series["muon-step-time"]
    phases = [name for name in timer_names(2)[1:] if f"{name}-time" in series]
    figure, axes = plt.subplots(2, 4, figsize=(16, 7), layout="constrained")
    timers = plt.subplot2grid((2, 4), (0, 0), colspan=2, rowspan=2, fig=figure)
    for ax in axes[:, :2].flat:
        ax.remove()
    iterations = sorted(step)
    bottom = [0.0] * len(iterations)
    for name in phases:
        values = [1e3 * series[f"{name}-time"].get(i, 0.0) for i in iterations]
        timers.bar(iterations, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    timers.plot(iterations, [1e3 * step[i] for i in iterations], "k.-", label="muon-step")
    timers.set(xlabel="iteration", ylabel="ms (max over ranks)",
               title="the Muon step and its level-2 phases")
    timers.legend(fontsize=8)
    # the plan's exchanges and collectives are constant; the bytes and the balance too, but
    # worth seeing beside the skips and the check interval's result
    for ax, name in zip(axes[:, 2:].flat, [s for s in SCALARS[2:] if s in series]):
        points = sorted(series[name].items())
        ax.plot([i for i, _ in points], [v for _, v in points], ".-")
        ax.set(title=name, xlabel="iteration")
    figure.suptitle(f"{Path(directory).name}: each timer is its max over ranks, so the stacked "
                    "phases of one iteration can exceed the step's max", fontsize=10)
    figure.savefig(out, dpi=90)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1], Path(sys.argv[2]) if len(sys.argv) > 2 else RESULTS / "event_file.png")
