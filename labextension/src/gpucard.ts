/**
 * One GPU's card: title, memory and utilization figures, and its live chart. What the
 * chart's areas and lines are is said once for all GPUs (the panel's legend), and what a
 * figure means is in its tooltip, so a card is two lines of figures over its chart.
 */
import { IGPU, IHistory } from './api';
import { GPUChart, IChartStyle } from './chart';
import { Attr, CSS } from './ids';
import { el, setAttr, setClauses, setHidden, setText } from './dom';
import { efficiency, peak, stackOnGPU } from './metrics';
import { formatBytes, formatPercent } from './format';

export class GPUCard {
  constructor(index: number, style: IChartStyle) {
    this.node = el('div', CSS.gpu);
    this.node.setAttribute(Attr.gpuIndex, String(index));
    this._title = el('div', CSS.gpuTitle);
    this._stats = el('div', CSS.gpuStats);
    this._released = el('div', `${CSS.gpuStats} ${CSS.gpuStats}-released`);
    this._released.title =
      'Released to host: GPU memory of released kernels, held in host memory now. ' +
      "Held while computing: the share of this GPU's memory-time held by kernels (over the " +
      "chart's window) during which the kernel holding it computed on this GPU (SM above 0).";
    const chartHost = el('div', CSS.chart);
    chartHost.title =
      'Areas: GPU memory held, stacked by kernel (colors as in the legend). Dashed: GPU ' +
      'memory used by every process. Steps: SM utilization, each step the highest of its ' +
      "moment, so a short burst stays visible. Memory axis: 0 to the GPU's total.";
    this._chart = new GPUChart(chartHost, style);
    this.node.append(this._title, this._stats, this._released, chartHost);
  }

  readonly node: HTMLDivElement;

  /** The chart's width; the panel reads it once per render, before writing. */
  measure(): number {
    return this._chart.measure();
  }

  update(
    gpu: IGPU,
    history: IHistory | null,
    order: string[],
    windowSeconds: number,
    chartWidth?: number
  ): string[] {
    // Raw figures as attributes: exact values for tests and scripts, whatever the formatting.
    setAttr(
      this.node,
      'data-memory-used',
      gpu.memory_used === null ? null : String(gpu.memory_used)
    );
    setAttr(this.node, 'data-released-bytes', String(gpu.released_bytes ?? 0));
    // A marker where kernels share the SMs: how many, and the load over the rebalance window
    const shared = gpu.contended
      ? ` · SM shared by ${gpu.computing?.length ?? 0} kernels, ${formatPercent(gpu.load)} busy`
      : '';
    setText(this._title, `GPU ${gpu.index}${gpu.name ? ` · ${gpu.name}` : ''}${shared}`);
    setAttr(this.node, 'data-contended', gpu.contended ? 'true' : null);
    setAttr(this._title, 'title', gpu.uuid ? `UUID ${gpu.uuid}` : null);
    const key = String(gpu.index);
    const series = history?.gpus[key];
    const highest = series ? peak(series.utilization) : null;
    setClauses(this._stats, [
      `${formatBytes(gpu.memory_used)} of ${formatBytes(gpu.memory_total)} used`,
      `SM ${formatPercent(gpu.utilization)}` +
        (highest !== null ? ` (peak ${formatPercent(highest)})` : '')
    ]);
    setAttr(
      this._stats,
      'title',
      "GPU memory used by every process, of the GPU's total; SM utilization now, and its " +
        "highest over the chart's window"
    );
    const released: string[] = [];
    if (gpu.released_bytes) {
      released.push(`${formatBytes(gpu.released_bytes)} released to host`);
    }
    if (history) {
      const eff = efficiency(history.kernels, history.interval, history.now, key);
      if (eff.ratio !== null) {
        released.push(`held while computing ${Math.round(eff.ratio * 100)} %`);
      }
    }
    setClauses(this._released, released);
    setHidden(this._released, released.length === 0);

    if (!history || !series) {
      return [];
    }
    const maxGap = Math.max(1, history.interval * 2.5);
    const stack = stackOnGPU(series.t, history.kernels, order, key, maxGap);
    this._chart.update(
      {
        x: series.t,
        stack,
        used: series.memory_used,
        utilization: series.utilization,
        total: gpu.memory_total,
        // From the first sample (at most the configured window ago) so a young server's
        // minute of history fills the chart instead of a sliver at its right edge.
        window: [
          Math.min(history.now - 30, Math.max(history.now - windowSeconds, series.t[0] ?? 0)),
          history.now
        ]
      },
      chartWidth
    );
    return stack.ids;
  }

  invalidate(): void {
    this._chart.invalidate();
  }

  dispose(): void {
    this._chart.dispose();
    this.node.remove();
  }

  private _title: HTMLDivElement;
  private _stats: HTMLDivElement;
  private _released: HTMLDivElement;
  private _chart: GPUChart;
}
