// Small wrappers over the vendored uPlot (static/vendor/uplot): time-series charts that fit their
// container and resize with it.

/* global uPlot */

const PALETTE = ["#2457c5", "#8e44ad", "#e0a106", "#1f7a3f", "#b3261e", "#16808a", "#7d5a3c"];

export function color(i) {
  return PALETTE[i % PALETTE.length];
}

function widthOf(container) {
  return Math.max(240, container.clientWidth - 34);
}

// The decimals that write every multiple of a tick step exactly (0.25 → 2, 0.0005 → 4, 50 → 0).
export function stepDecimals(step) {
  for (let decimals = 0; decimals < 20; decimals += 1) {
    const scaled = Math.abs(step) * 10 ** decimals;
    if (Math.abs(scaled - Math.round(scaled)) <= 1e-9 * Math.max(1, scaled)) return decimals;
  }
  return 20;
}

// Axis tick labels with the decimals their step needs: uPlot's default rounds to three decimals,
// so ticks 0.0005 apart read "0.001", "0.001", "0.002".
export function tickLabels(splits, step) {
  const decimals = stepDecimals(step);
  const format = new Intl.NumberFormat("en-US", { minimumFractionDigits: decimals, maximumFractionDigits: decimals });
  return splits.map((value) => (value === null || value === undefined ? "" : format.format(value)));
}

// series: [{label, color, dash, stepped, value: fn}], data: [xs, ...ys]
// xRange: [min, max] in seconds pins the time axis (an audit range), instead of fitting the data.
export function timeChart(container, { series, data, height = 200, yLabel = "", yRange = null, xRange = null }) {
  const opts = {
    width: widthOf(container),
    height,
    cursor: { drag: { x: false, y: false } },
    scales: {
      x: xRange ? { time: true, range: () => xRange } : { time: true },
      y: yRange ? { range: yRange } : { auto: true },
    },
    axes: [{}, { label: yLabel, size: 56, values: (u, splits, axisIdx, space, step) => tickLabels(splits, step) }],
    legend: { live: true },
    series: [
      {},
      ...series.map((s, i) => ({
        label: s.label,
        stroke: s.color || color(i),
        width: 2,
        dash: s.dash,
        spanGaps: s.spanGaps ?? true,
        paths: s.stepped ? uPlot.paths.stepped({ align: 1 }) : undefined,
        value: s.value,
        points: { show: s.points ?? false, size: 6 },
      })),
    ],
  };
  const chart = new uPlot(opts, data, container);
  const observer = new ResizeObserver(() => chart.setSize({ width: widthOf(container), height }));
  observer.observe(container);
  const destroy = chart.destroy.bind(chart);
  chart.destroy = () => {
    observer.disconnect();
    destroy();
  };
  return chart;
}
