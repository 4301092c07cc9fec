"""Timing figures show the spread of their repeats: the measurements keep every repeat, report the median (or the
best, where named), and the figures' bars run exactly from the fastest to the slowest repeat (lessons 04, 08, 09, 11,
12, 17)."""
import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
from matplotlib.container import ErrorbarContainer  # noqa: E402

from course_lib.views import plots, plots_long, plots_perf, plots_roofline  # noqa: E402
from course_lib.measure.long_context import step_curve, step_times  # noqa: E402
from course_lib.measure.race import race  # noqa: E402
from course_lib.measure.speed import throughput_latency  # noqa: E402
from course_lib.runtime import median  # noqa: E402
from course_lib.runner.model import Model  # noqa: E402


@pytest.fixture(scope="module")
def small(tiny):
    return Model.from_transformers(tiny)


def bar_ends(ax) -> list[float]:
    """low, high, low, high... of every error bar drawn on ax, in drawing order, along the bars' own axis."""
    ends = []
    for container in ax.containers:
        if isinstance(container, ErrorbarContainer):
            for segment in container.lines[2][0].get_segments():
                (x0, y0), (x1, y1) = segment
                ends += sorted((y0, y1) if x0 == x1 else (x0, x1))
    return ends


def flat(pairs) -> list[float]:
    return [v for pair in pairs for v in pair]


def test_step_curve_keeps_the_fastest_and_slowest_and_the_figure_draws_them(small):
    curve = step_curve(small, [16, 48], repeats=3)
    for point in curve:
        assert point["ms_min"] <= point["ms"] <= point["ms_max"]
    assert len(step_times(small, 16, repeats=4)) == 4
    ax = plots_long.plot_step_curve({"tiny": curve})
    assert bar_ends(ax) == pytest.approx(flat((c["ms_min"], c["ms_max"]) for c in curve))
    plt.close("all")


def test_throughput_latency_reports_the_median_of_its_repeats(tiny, tokenizer):
    prompt = tokenizer.encode("Hello there")
    rows = throughput_latency(tiny, prompt, [1, 2], new_tokens=4, repeats=3)
    for row in rows:
        assert len(row["seconds_runs"]) == 3
        assert row["seconds"] == median(row["seconds_runs"]) == row["latency_s"]
        assert row["tokens_per_s"] == pytest.approx(row["batch"] * 4 / row["seconds"])
    ax = plots_perf.plot_throughput_latency(rows)
    right = [other for other in ax.figure.axes if other is not ax][0]
    assert bar_ends(right) == pytest.approx(flat((min(r["seconds_runs"]), max(r["seconds_runs"])) for r in rows))
    assert bar_ends(ax) == pytest.approx(flat((r["batch"] * 4 / max(r["seconds_runs"]), r["batch"] * 4 / min(r["seconds_runs"]))
                                              for r in rows))
    plt.close("all")
    with pytest.raises(ValueError, match="repeats"):
        throughput_latency(tiny, prompt, [1], new_tokens=4, repeats=0)


def test_race_keeps_every_repeat_and_its_bar_is_the_best(small, tiny, tokenizer):
    prompt = tokenizer.encode("Once upon a time")
    result = race(small, tiny, tokenizer, prompt, n_new=4, repeats=3)
    assert len(result["tokens_per_s_runs"]) == len(result["generate_tokens_per_s_runs"]) == 3
    assert result["tokens_per_s"] == max(result["tokens_per_s_runs"])
    assert result["generate_tokens_per_s"] == max(result["generate_tokens_per_s_runs"])
    runs = [result["generate_tokens_per_s_runs"], result["tokens_per_s_runs"]]
    ax = plots_perf.plot_race(["library", "ours"], [result["generate_tokens_per_s"], result["tokens_per_s"]], runs=runs)
    assert bar_ends(ax) == pytest.approx(flat((min(r), max(r)) for r in runs))
    assert np.isclose([b.get_width() for b in ax.patches], [result["generate_tokens_per_s"], result["tokens_per_s"]]).all()
    plt.close("all")


def test_plot_xy_and_the_decode_bytes_figure_draw_the_spread_they_are_given():
    spread = [(0.8, 1.5), (1.9, 2.2), (2.5, 3.9)]
    ax = plots.plot_xy([1, 2, 3], [1.0, 2.0, 3.0], "x", "ms", spread=spread)
    assert bar_ends(ax) == pytest.approx(flat(spread))
    assert ax.get_ylim()[1] >= 3.9  # the slowest repeat is inside the panel
    ax = plots_roofline.plot_decode_bytes(["a", "b"], [100e6, 400e6], [5.0, 20.0], 20e9, spread=[(4.0, 7.0), (19.0, 30.0)])
    assert bar_ends(ax) == pytest.approx([4.0, 7.0, 19.0, 30.0])
    plt.close("all")
