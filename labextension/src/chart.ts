/**
 * One GPU's live chart: memory held stacked by kernel (allocation, left axis, GiB) against
 * SM utilization (a line on the right axis, %), so "held but idle" shows as area under no line.
 *
 * The uPlot instance is reused between refreshes (`setData`); it is only rebuilt when the set
 * of kernels on the GPU changes (the series list changes) or the theme changes.
 */
import uPlot from 'uplot';

import { timeTickLabel } from './format';
import { IStack } from './metrics';

const GiB = 1024 ** 3;
const HEIGHT = 130;
/** The time axis' height: tick (4) + gap (3) + a 10 px line of text with its descenders. */
const X_AXIS_SIZE = 22;

export interface IChartData {
  /** Epoch seconds. */
  x: number[];
  stack: IStack;
  /** GPU memory used as the device reports it (bytes); includes memory no kernel holds. */
  used: (number | null)[];
  /** GPU SM utilization, %. */
  utilization: (number | null)[];
  /** Device memory (bytes), the top of the memory axis; null when unknown. */
  total: number | null;
  /** The visible window [from, to] in epoch seconds. */
  window: [number, number];
}

export interface IChartStyle {
  color(kernelId: string): string;
  label(kernelId: string): string;
}

/** Read a JupyterLab CSS variable so the canvas follows the light/dark theme. */
function cssVar(element: HTMLElement, name: string, fallback: string): string {
  const value = getComputedStyle(element).getPropertyValue(name).trim();
  return value || fallback;
}

export class GPUChart {
  constructor(host: HTMLElement, style: IChartStyle) {
    this._host = host;
    this._style = style;
  }

  /** Forget the uPlot instance so the next update rebuilds it (after a theme change). */
  invalidate(): void {
    this._plot?.destroy();
    this._plot = null;
    this._key = '';
  }

  /** The width the chart can take (reading it forces a layout: do it before DOM writes). */
  measure(): number {
    return Math.floor(this._host.clientWidth);
  }

  update(data: IChartData, width: number = this.measure()): void {
    if (width <= 0) {
      return; // hidden: nothing to lay out; the next visible refresh draws it
    }
    this._window = data.window;
    this._total = data.total;
    const key = data.stack.ids.join(',');
    const aligned: uPlot.AlignedData = [
      data.x,
      ...data.stack.cumulative.map(series => series.map(v => v / GiB)),
      data.used.map(v => (v === null ? null : v / GiB)),
      data.utilization
    ];
    if (!this._plot || key !== this._key) {
      this._plot?.destroy();
      this._key = key;
      this._plot = new uPlot(this._options(data.stack.ids, width), aligned, this._host);
      this._width = width;
      return;
    }
    if (width !== this._width) {
      this._width = width;
      this._plot.setSize({ width, height: HEIGHT });
    }
    this._plot.setData(aligned);
  }

  dispose(): void {
    this.invalidate();
  }

  private _options(ids: string[], width: number): uPlot.Options {
    const axisColor = cssVar(this._host, '--jp-ui-font-color2', '#757575');
    const gridColor = cssVar(this._host, '--jp-border-color2', '#e0e0e0');
    const utilColor = cssVar(this._host, '--jp-warn-color0', '#e65100');
    const usedColor = cssVar(this._host, '--jp-ui-font-color1', '#424242');
    const font = `10px ${cssVar(this._host, '--jp-ui-font-family', 'sans-serif')}`;
    const axis = {
      stroke: axisColor,
      font,
      size: 40,
      grid: { stroke: gridColor, width: 1 },
      ticks: { stroke: gridColor, width: 1 }
    };
    const series: uPlot.Series[] = [{}];
    const bands: uPlot.Band[] = [];
    ids.forEach((id, k) => {
      const color = this._style.color(id);
      series.push({
        label: this._style.label(id),
        scale: 'mem',
        stroke: color,
        width: 1,
        fill: color + '66',
        points: { show: false }
      });
      if (k > 0) {
        // Fill between this kernel's cumulative line and the one below it.
        bands.push({ series: [k + 1, k], fill: color + '66' });
      }
    });
    series.push({
      label: 'GPU memory used',
      scale: 'mem',
      stroke: usedColor,
      width: 1,
      dash: [4, 3],
      points: { show: false }
    });
    series.push({
      label: 'SM utilization',
      scale: 'pct',
      stroke: utilColor,
      width: 2,
      points: { show: false }
    });
    return {
      width,
      height: HEIGHT,
      legend: { show: false },
      cursor: { drag: { x: false, y: false }, points: { show: false } },
      series,
      bands,
      scales: {
        x: { time: true, range: () => this._window },
        // Scaled to what is held (with headroom) so 1 GiB on an 80 GiB card is still
        // readable; never above the device's memory. The figures above give the total.
        mem: {
          range: (_u, _min, max) => {
            const top = Math.max((max || 0) * 1.25, 1);
            return [0, this._total ? Math.min(top, this._total / GiB) : top];
          }
        },
        pct: { range: [0, 100] }
      },
      axes: [
        {
          ...axis,
          // One line that fits the axis' height: uPlot's default puts the date on a second
          // line under the first label, below the canvas' edge, cut off.
          size: X_AXIS_SIZE,
          gap: 3,
          ticks: { ...axis.ticks, size: 4 },
          values: (_u, splits, _axis, _space, incr) => splits.map(t => timeTickLabel(t, incr))
        },
        {
          ...axis,
          scale: 'mem',
          values: (_u, splits) => splits.map(v => `${+v.toFixed(1)}G`)
        },
        {
          ...axis,
          scale: 'pct',
          side: 1,
          size: 44,
          grid: { show: false },
          values: (_u, splits) => splits.map(v => `${v}%`)
        }
      ]
    };
  }

  private _host: HTMLElement;
  private _style: IChartStyle;
  private _plot: uPlot | null = null;
  private _key = '';
  private _width = 0;
  private _window: [number, number] = [0, 1];
  private _total: number | null = null;
}
