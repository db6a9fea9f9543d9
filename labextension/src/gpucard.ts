/**
 * One GPU's card: title, memory and utilization figures, and its live chart.
 */
import { IGPU, IHistory } from './api';
import { GPUChart, IChartStyle } from './chart';
import { Attr, CSS } from './ids';
import { el, setAttr, setClauses, setText } from './dom';
import { efficiency, stackOnGPU } from './metrics';
import { formatBytes, formatPercent } from './format';

export class GPUCard {
  constructor(index: number, style: IChartStyle) {
    this.node = el('div', CSS.gpu);
    this.node.setAttribute(Attr.gpuIndex, String(index));
    this._title = el('div', CSS.gpuTitle);
    this._stats = el('div', CSS.gpuStats);
    this._released = el('div', `${CSS.gpuStats} ${CSS.gpuStats}-released`);
    const chartHost = el('div', CSS.chart);
    this._chart = new GPUChart(chartHost, style);
    this._legend = el(
      'div',
      `${CSS.chart}-legend`,
      'areas: memory held, stacked by kernel · dashed: GPU memory used · line: SM utilization %'
    );
    this.node.append(this._title, this._stats, this._released, chartHost, this._legend);
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
  ): void {
    // Raw figures as attributes: exact values for tests and scripts, whatever the formatting.
    setAttr(
      this.node,
      'data-memory-used',
      gpu.memory_used === null ? null : String(gpu.memory_used)
    );
    setAttr(this.node, 'data-released-bytes', String(gpu.released_bytes ?? 0));
    // A marker where kernels share the SMs: how many, and the load over the last 10 minutes
    const shared = gpu.contended
      ? ` · SM shared by ${gpu.computing?.length ?? 0} kernels, ${formatPercent(gpu.load)} busy`
      : '';
    setText(this._title, `GPU ${gpu.index}${gpu.name ? ` · ${gpu.name}` : ''}${shared}`);
    setAttr(this.node, 'data-contended', gpu.contended ? 'true' : null);
    const free =
      gpu.memory_total !== null && gpu.memory_used !== null
        ? gpu.memory_total - gpu.memory_used
        : null;
    setClauses(this._stats, [
      `used ${formatBytes(gpu.memory_used)} of ${formatBytes(gpu.memory_total)}`,
      `free ${formatBytes(free)}`,
      `SM ${formatPercent(gpu.utilization)}`
    ]);
    const released = [`released to host now: ${formatBytes(gpu.released_bytes ?? 0)}`];
    const key = String(gpu.index);
    if (history) {
      const eff = efficiency(history.kernels, history.interval, history.now, key);
      if (eff.ratio !== null) {
        released.push(`held while computing ${Math.round(eff.ratio * 100)} %`);
      }
    }
    setClauses(this._released, released);

    const series = history?.gpus[key];
    if (!history || !series) {
      return;
    }
    const maxGap = Math.max(1, history.interval * 2.5);
    this._chart.update(
      {
        x: series.t,
        stack: stackOnGPU(series.t, history.kernels, order, key, maxGap),
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
  private _legend: HTMLDivElement;
  private _chart: GPUChart;
}
