/**
 * One GPU's live chart: memory held stacked by kernel (allocation, left axis, from 0 to the
 * GPU's total memory) against SM utilization (steps on the right axis, %), so "held but idle"
 * shows as area under no line, and a GPU that looks full is full.
 *
 * The uPlot instance is reused between refreshes (`setData`); it is only rebuilt when the set
 * of kernels on the GPU changes (the series list changes) or the theme changes.
 */
import uPlot from 'uplot';

import { setAttr } from './dom';
import { relativeTicks, relativeTimeLabel } from './format';
import { IStack, slotPeaks } from './metrics';

const GiB = 1024 ** 3;
const HEIGHT = 130;
/** The time axis' height: tick (4) + gap (3) + a 10 px line of text with its descenders. */
const X_AXIS_SIZE = 22;
/** The memory and utilization axes' widths (px): the plot is the chart's width less these. */
const MEM_AXIS_SIZE = 36;
const PCT_AXIS_SIZE = 38;
/** Utilization is drawn in slots this wide (px) at least, each at its highest sample. */
const SLOT_PX = 4;
/** At most one time label per this many px. */
const TICK_PX = 48;

/** The plot area's width (px) for a chart `width` px wide. */
export function plotWidth(width: number): number {
  return Math.max(1, width - MEM_AXIS_SIZE - PCT_AXIS_SIZE);
}

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
    const [from, to] = data.window;
    const slotSeconds = ((to - from) / plotWidth(width)) * SLOT_PX;
    const aligned: uPlot.AlignedData = [
      data.x,
      ...data.stack.cumulative.map(series => series.map(v => v / GiB)),
      data.used.map(v => (v === null ? null : v / GiB)),
      slotPeaks(data.x, data.utilization, slotSeconds)
    ];
    if (!this._plot || key !== this._key) {
      this._plot?.destroy();
      this._key = key;
      this._width = width; // before uPlot is built: its time axis reads it
      this._plot = new uPlot(this._options(data.stack.ids, width), aligned, this._host);
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
    // a light fill under the utilization steps, where the theme's color is a plain hex one
    const utilFill = /^#[0-9a-f]{6}$/i.test(utilColor) ? utilColor + '33' : undefined;
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
      fill: utilFill,
      width: 1.5,
      // steps, each slot at its peak (slotPeaks): a short burst keeps a visible width
      paths: uPlot.paths.stepped!({ align: 1 }),
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
        // From 0 to the GPU's memory: a chart that looks full is a GPU that is full. (Scaled
        // to what is held, 3 GiB of a 16 GiB GPU filled the chart.) Unknown total: what is
        // shown, with headroom.
        mem: {
          range: (_u, _min, max) => {
            const top = this._total ? this._total / GiB : Math.max((max || 0) * 1.25, 1);
            setAttr(this._host, 'data-memory-axis-top', String(Math.round(top * GiB)));
            return [0, top];
          }
        },
        pct: { range: [0, 100] }
      },
      axes: [
        {
          ...axis,
          // Ages at round steps back from now ("-4 min", "-2 min", "now"), several per
          // chart: a clock time under a 10-minute chart said neither how old nor how long.
          size: X_AXIS_SIZE,
          gap: 3,
          ticks: { ...axis.ticks, size: 4 },
          splits: () => relativeTicks(this._window[0], this._window[1], this._maxTicks()),
          values: (_u, splits) => {
            const labels = splits.map(t => relativeTimeLabel(t, this._window[1]));
            // what the canvas shows, for tests and scripts
            setAttr(this._host, 'data-time-labels', labels.join(' | '));
            return labels;
          }
        },
        {
          ...axis,
          scale: 'mem',
          size: MEM_AXIS_SIZE,
          gap: 3,
          ticks: { ...axis.ticks, size: 4 },
          // 0, half and all of the GPU's memory
          splits: (_u, _axis, min, max) => [min, (min + max) / 2, max],
          values: (_u, splits) => splits.map(v => `${+v.toFixed(1)}G`)
        },
        {
          ...axis,
          scale: 'pct',
          side: 1,
          size: PCT_AXIS_SIZE,
          gap: 3,
          ticks: { ...axis.ticks, size: 4 },
          grid: { show: false },
          splits: () => [0, 50, 100],
          values: (_u, splits) => splits.map(v => `${v}%`)
        }
      ]
    };
  }

  /** Time labels that fit the plot's width, each about TICK_PX apart at least. */
  private _maxTicks(): number {
    return Math.max(2, Math.floor(plotWidth(this._width) / TICK_PX) + 1);
  }

  private _host: HTMLElement;
  private _style: IChartStyle;
  private _plot: uPlot | null = null;
  private _key = '';
  private _width = 0;
  private _window: [number, number] = [0, 1];
  private _total: number | null = null;
}
