/**
 * The charts' legend, once for every GPU: a swatch per kernel whose memory a chart shows (in
 * its chart color), then what the dashed line and the steps are. What each means in full is
 * in the tooltips, so the legend takes a line or two of the panel, not a paragraph per GPU.
 */
import { CSS } from './ids';
import { el, setAttr, setHidden, setText } from './dom';

export interface ILegendKernel {
  id: string;
  label: string;
  color: string;
}

export const LEGEND_CSS = `${CSS.chart}-legend`;

export class ChartLegend {
  readonly node = el('div', LEGEND_CSS);

  constructor() {
    this.node.setAttribute('role', 'list');
    this.node.setAttribute('aria-label', 'chart legend');
    this._kernels = el('span', `${LEGEND_CSS}-kernels`);
    this.node.append(
      this._kernels,
      item(
        'used',
        'GPU used',
        'Dashed line: GPU memory used by every process (a kernel’s and any other), ' +
          'left axis, from 0 to the GPU’s total memory'
      ),
      item(
        'sm',
        'SM %',
        'Steps: SM utilization of the GPU, right axis; each step is the highest value of its ' +
          'moment, so a burst of a few seconds stays visible'
      )
    );
    setHidden(this.node, true);
  }

  /** The kernels with memory in some chart, in stacking order; hidden with no chart drawn. */
  update(kernels: ILegendKernel[], charts: boolean): void {
    setHidden(this.node, !charts);
    const key = kernels.map(k => `${k.id}\u0000${k.label}\u0000${k.color}`).join('\u0001');
    if (key === this._key) {
      return;
    }
    this._key = key;
    this._kernels.replaceChildren(
      ...kernels.map(k => {
        const entry = item(
          'kernel',
          k.label,
          `Area: GPU memory held by ${k.label}, stacked on the kernels below it`
        );
        entry.setAttribute('data-kernel-id', k.id);
        (entry.firstChild as HTMLElement).style.background = k.color;
        return entry;
      })
    );
  }

  private _kernels: HTMLSpanElement;
  private _key = '';
}

/** One legend entry: a swatch of `kind` (kernel, used, sm) and its label, explained on hover. */
function item(kind: string, label: string, title: string): HTMLSpanElement {
  const entry = el('span', `${LEGEND_CSS}-item`);
  entry.setAttribute('role', 'listitem');
  entry.setAttribute('data-kind', kind);
  setAttr(entry, 'title', title);
  const swatch = el('span', `${LEGEND_CSS}-swatch`);
  const text = el('span', `${LEGEND_CSS}-label`);
  setText(text, label);
  entry.append(swatch, text);
  return entry;
}
