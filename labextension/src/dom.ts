/**
 * Tiny DOM helpers: the panel updates existing nodes in place and only touches the DOM
 * when a value changed, which keeps a 50-kernel refresh cheap.
 */

export function el<K extends keyof HTMLElementTagNameMap>(
  tag: K,
  className?: string,
  text?: string
): HTMLElementTagNameMap[K] {
  const node = document.createElement(tag);
  if (className) {
    node.className = className;
  }
  if (text !== undefined) {
    node.textContent = text;
  }
  return node;
}

export function setText(node: HTMLElement, text: string): void {
  if (node.textContent !== text) {
    node.textContent = text;
  }
}

export function setAttr(node: Element, name: string, value: string | null): void {
  if (value === null) {
    if (node.hasAttribute(name)) {
      node.removeAttribute(name);
    }
  } else if (node.getAttribute(name) !== value) {
    node.setAttribute(name, value);
  }
}

export function setHidden(node: HTMLElement, hidden: boolean): void {
  if (node.hidden !== hidden) {
    node.hidden = hidden;
  }
}

export function setDisabled(node: HTMLButtonElement, disabled: boolean): void {
  if (node.disabled !== disabled) {
    node.disabled = disabled;
  }
}

const SVG_NS = 'http://www.w3.org/2000/svg';

/** A utilization sparkline (0-100 %) as an SVG polyline whose points are replaced in place. */
export class Sparkline {
  constructor(className: string, width = 64, height = 16) {
    this._width = width;
    this._height = height;
    this.node = document.createElementNS(SVG_NS, 'svg');
    this.node.setAttribute('class', className);
    this.node.setAttribute('width', String(width));
    this.node.setAttribute('height', String(height));
    this.node.setAttribute('viewBox', `0 0 ${width} ${height}`);
    this.node.setAttribute('preserveAspectRatio', 'none');
    this.node.setAttribute('aria-hidden', 'true');
    this._line = document.createElementNS(SVG_NS, 'polyline');
    this.node.appendChild(this._line);
  }

  readonly node: SVGSVGElement;

  /** Draw the last `width / 2` samples; nulls count as 0. */
  update(values: (number | null)[]): void {
    const n = Math.max(2, Math.floor(this._width / 2));
    const tail = values.slice(-n);
    const step = this._width / Math.max(1, n - 1);
    const offset = (n - tail.length) * step;
    const h = this._height - 1;
    const points = tail
      .map((v, i) => {
        const y = h - (Math.min(100, Math.max(0, v ?? 0)) / 100) * (h - 1);
        return `${(offset + i * step).toFixed(1)},${y.toFixed(1)}`;
      })
      .join(' ');
    if (this._points !== points) {
      this._points = points;
      this._line.setAttribute('points', points);
    }
  }

  private _width: number;
  private _height: number;
  private _line: SVGPolylineElement;
  private _points = '';
}

/**
 * Text of clauses joined by " · " that wraps only between clauses ("free 16.0 GiB" never
 * breaks before "GiB"): one no-wrap span per clause, the dot ending the line it is on.
 * `node.textContent` is `parts.join(' · ')`. Rewrites the node only when the text changed.
 */
export function setClauses(node: HTMLElement, parts: string[]): void {
  const text = parts.join(' · ');
  if (node.textContent === text && node.childElementCount === parts.length) {
    return;
  }
  const children: (Node | string)[] = [];
  parts.forEach((part, i) => {
    const last = i === parts.length - 1;
    children.push(el('span', CLAUSE, last ? part : `${part} ·`));
    if (!last) {
      children.push(' ');
    }
  });
  node.replaceChildren(...children);
}

/** The class of a clause of setClauses (white-space: nowrap). */
export const CLAUSE = 'jp-GPUShare-clause';
