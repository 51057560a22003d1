"""docs/scale-model.md's generated tables, each between its two marker comments, made from the
committed `make scale` run (benchmarks/results/scale.json), so that every figure they show is
one run's:

    python -m benchmarks.scale_tables

writes them; tests/plan/test_scale_tables.py holds the committed page to the committed file. The
run they are made from: `make scale SCALE_ARGS="..."` with SCALE_RUN's arguments.
"""

from pathlib import Path

from benchmarks.docs_table import with_table

REPO = Path(__file__).resolve().parent.parent
RESULTS, PAGE = REPO / "benchmarks" / "results" / "scale.json", REPO / "docs" / "scale-model.md"
SCALE_RUN = ("--rates benchmarks/rates/h100.json --models llama-70b deepseek-v3 kimi-k2 "
             "--world-sizes 256 1024 2048 --tensor-parallel 1 2 4 8")
NAMES = {"llama-8b": "Llama-8B", "llama-70b": "Llama-70B", "deepseek-v3": "DeepSeek-V3",
         "kimi-k2": "Kimi K2"}
# The headline: the MoE flagships, and Llama-70B at the layout a 70B trains with (TP 8).
HEADLINE = (("deepseek-v3", 1), ("kimi-k2", 1), ("llama-70b", 8))
VARIANTS = ("muon", "adamuon", "normuon", "namo")


def _ms(value: float) -> str:
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


def _rows(results: list[dict], pairs=None) -> list[dict]:
    """The results in the tables' order: by model as NAMES lists them, TP, then W; of `pairs`
    ((model, TP)) only, where given."""
    order = list(NAMES)
    chosen = [r for r in results
              if pairs is None or (r["model"], r["tensor_parallel"]) in pairs]
    return sorted(chosen, key=lambda r: (order.index(r["model"]), r["tensor_parallel"], r["world"]))


def _table(header: list[str], rows: list[list[str]], aligned: str) -> str:
    """A markdown table: `aligned` one letter a column, l (left) or r (right)."""
    lines = ["| " + " | ".join(header) + " |",
             "| " + " | ".join("---" if a == "l" else "---:" for a in aligned) + " |"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def headline(results: list[dict]) -> str:
    """Ours (owner mode, and teams) at the flagships' own batches and at NVIDIA's, the critical
    path's gather, Newton-Schulz and scatter, the Newton-Schulz floor, and megatron-core's
    layer-wise placement beside them."""
    rows = []
    for r in _rows(results, HEADLINE):
        ours, teams, layer_wise = (r["modes"][m] for m in ("owner", "teams",
                                                            "whole-matrix-per-rank"))
        rows.append([
            NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"]),
            str(r["expert_parallel"]), f"{r['tokens_per_step'] / 1e6:.1f}M",
            _ms(r["ns_floor_ms"]),
            " / ".join(_ms(ours[f"path_{stage}_ms"])
                       for stage in ("gather", "newton_schulz", "scatter")),
            f"{_ms(ours['step_ms'])} ({_ms(ours['syrk_step_ms'])})",
            f"{ours['overhead_with_latency']:.2%}", f"{ours['overhead_at_nvidia_batch']:.1%}",
            f"{_ms(teams['step_ms'])}, {teams['overhead_with_latency']:.2%}",
            f"{_ms(layer_wise['step_ms'])}, {layer_wise['overhead_with_latency']:.2%}, "
            f"{layer_wise['overhead_at_nvidia_batch']:.1%}"])
    return _table(["model", "W", "TP", "EP", "tokens/step", "NS floor ms",
                   "ours: gather / NS / scatter on the path, ms", "ours: step ms (SYRK)",
                   "ours: overhead", "ours at NVIDIA's 8.4M", "teams: step ms, overhead",
                   "layer-wise: step ms, overhead, at 8.4M"], rows, "lrrrrrrrrrrr")


def gather_inside(results: list[dict]) -> str:
    """The headline rows with --muon-gather-inside-backward beside ours without it: the
    critical path after backward split into gathers, Newton-Schulz and scatters, the step, and
    the overhead at the model's own batch and at NVIDIA's, at each micro-batch of the run (the
    last one's backward is where its gathers run, beside Megatron-FSDP's own traffic), with the
    Newton-Schulz floor."""
    def path(mode: dict) -> str:
        return " / ".join(_ms(mode[f"path_{stage}_ms"])
                          for stage in ("gather", "newton_schulz", "scatter"))

    def step(mode: dict) -> str:
        return (f"{_ms(mode['step_ms'])}, {mode['overhead_with_latency']:.2%}, "
                f"{mode['overhead_at_nvidia_batch']:.1%}")

    rows = []
    for r in _rows(results, HEADLINE):
        ours = r["modes"]["owner"]
        rows.append([NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"]),
                     _ms(r["ns_floor_ms"]), "at the step", "", path(ours), step(ours)])
        for inside in r["gather_inside"]:
            rows.append(["", "", "", "",
                         f"{inside['micro_batch_tokens'] / 1024:g}K tokens: "
                         f"{inside['matrices_ahead']} of {inside['matrices']} matrices, in "
                         f"{inside['exchanges_ahead']} of {inside['exchanges']} exchanges",
                         f"{_ms(inside['backward_ms'])} ms, {inside['free_share']:.0%} free",
                         path(inside), step(inside)])
    return _table(["model", "W", "TP", "NS floor ms", "gather: micro-batch, ahead",
                   "last micro-batch's backward, network free",
                   "gather / NS / scatter on the path, ms",
                   "step ms, overhead, at NVIDIA's 8.4M"], rows, "lrrrlrrr")


# The rows of the Gram table: the dense model at TP 1 and 8, the MoE flagships (issue 84).
GRAM = (("llama-70b", 1), ("llama-70b", 8), ("deepseek-v3", 1), ("kimi-k2", 1))


def gram(results: list[dict]) -> str:
    """Ours with --muon-gram-newton-schulz beside ours without it: how many matrices take it,
    the Newton-Schulz floors (total FLOPs / W at the matmul rate: standard's, Gram's), the
    critical path's Newton-Schulz, the step, and the overhead at the model's own batch and at
    NVIDIA's; "below" where Gram's Newton-Schulz on the path is shorter than standard's floor."""
    rows = []
    for r in _rows(results, GRAM):
        ours, with_gram = r["modes"]["owner"], r["gram"]
        below = with_gram["path_newton_schulz_ms"] < r["ns_floor_ms"]
        rows.append([
            NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"]),
            f"{with_gram['matrices_gram']} of {with_gram['newton_schulz_matrices']}",
            f"{_ms(r['ns_floor_ms'])} / {_ms(with_gram['ns_floor_ms'])}",
            f"{_ms(ours['path_newton_schulz_ms'])} / {_ms(with_gram['path_newton_schulz_ms'])}"
            + (" (below)" if below else ""),
            f"{_ms(ours['step_ms'])} / {_ms(with_gram['step_ms'])}",
            f"{ours['overhead_with_latency']:.2%} / {with_gram['overhead_with_latency']:.2%}",
            f"{ours['overhead_at_nvidia_batch']:.2%} / "
            f"{with_gram['overhead_at_nvidia_batch']:.2%}"])
    return _table(["model", "W", "TP", "Gram on", "NS floor ms: standard / Gram",
                   "NS on the path ms: ours / with Gram", "step ms", "overhead",
                   "at NVIDIA's 8.4M"], rows, "lrrrrrrrr")


def modes(results: list[dict]) -> str:
    """Every row of the run: each mode's overhead with latency, the owners' busiest / ideal."""
    names = ("owner", "teams", "owner-by-bytes", "whole-matrix-per-rank", "allgather")
    rows = [[NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"]),
             f"{r['modes']['owner']['busiest_over_ideal']:.2f}",
             f"{r['modes']['teams']['busiest_over_ideal']:.2f}"]
            + [f"{r['modes'][mode]['overhead_with_latency']:.2%}" for mode in names]
            for r in _rows(results)]
    return _table(["model", "W", "TP", "busiest / ideal: owner", "teams"]
                  + [f"{mode}: overhead" for mode in names], rows, "lrrrrrrrrr")


def variants(results: list[dict]) -> str:
    """The Muon family, owner mode: exchanges (at least), overhead with latency, working GB."""
    rows = []
    for r in _rows(results):
        v = [r["variants"][name] for name in VARIANTS]
        rows.append([NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"]),
                     " / ".join(f"{x['exchanges']} ({x['fewest_exchanges']})" for x in v),
                     " / ".join(f"{x['overhead_with_latency']:.2%}" for x in v),
                     " / ".join(f"{x['working_gb']:.2f}" for x in v)])
    return _table(["model", "W", "TP", "exchanges (at least), Muon / AdaMuon / NorMuon / NAMO",
                   "overhead with latency", "working memory GB"], rows, "lrrrrr")


def memory(results: list[dict]) -> str:
    """GB per rank (the largest rank's of each): at rest, Muon's working memory at the default
    budget and at 5% of an 80 GB GPU, one matrix alone, and what forward-backward must add."""
    rows = []
    for r in _rows(results):
        m = r["memory_gb"]
        rows.append([NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"])] + [
            f"{m[key]:.2f}" for key in ("weights", "gradients", "adam_state", "muon_state")] + [
            f"{m['muon_working']:.2f} / {m['muon_working_at_budget']:.2f}",
            f"{m['largest_alone']:.2f}", f"{m['break_even']:.2f}"])
    return _table(["model", "W", "TP", "weights", "grads", "Adam state", "Muon state",
                   "Muon working (default / 4 GB budget)", "one alone",
                   "Muon <= Adam if fwd-bwd adds"], rows, "lrrrrrrrrr")


def offload(results: list[dict]) -> str:
    """--optimizer-cpu-offload: the state on the device without and with it, the GB copied each
    way a step and their time over each host link, beside our step."""
    rows = []
    for r in _rows(results):
        m = r["memory_gb"]
        rows.append([NAMES[r["model"]], str(r["world"]), str(r["tensor_parallel"]),
                     f"{m['muon_state']:.2f}", f"{m['offloaded_state']:.2f}",
                     f"{m['offload_each_way']:.2f}", f"{m['offload_ms_PCIe']:.1f} ms",
                     f"{m['offload_ms_C2C']:.1f} ms",
                     f"{_ms(r['modes']['owner']['step_ms'])} ms"])
    return _table(["model", "W", "TP", "Muon + Adam state on the device",
                   "with offload: state on the device at once", "copied each way per step",
                   "PCIe Gen5 (55 GB/s)", "NVLink-C2C (450 GB/s)", "Muon step (owner)"],
                  rows, "lrrrrrrrr")


TABLES = {"headline": headline, "gather inside": gather_inside, "gram": gram, "modes": modes,
          "variants": variants, "memory": memory,
          "offload": offload}


def markers(name: str) -> tuple[str, str]:
    return (f"<!-- scale table {name}: python -m benchmarks.scale_tables -->",
            f"<!-- end of scale table {name} -->")


def page_with_tables(page: str, results: list[dict]) -> str:
    """`page` with each table of TABLES made from `results` between its markers."""
    for name, table in TABLES.items():
        start, end = markers(name)
        if start not in page or end not in page:
            raise ValueError(f"{PAGE.name} lacks the markers of scale table {name}: {start}")
        page = with_table(page, start, end, table(results))
    return page


def main() -> None:
    import json

    results = json.loads(RESULTS.read_text())["results"]
    PAGE.write_text(page_with_tables(PAGE.read_text(), results))
    print(f"wrote {PAGE.relative_to(REPO)}'s tables {', '.join(TABLES)} from "
          f"{RESULTS.relative_to(REPO)}")


if __name__ == "__main__":
    main()
