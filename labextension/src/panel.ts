/**
 * The side panel: GPUs with live charts, the efficiency line, and one row per kernel.
 *
 * Rendering is keyed: GPU cards by index and kernel rows by kernel id are created once and
 * updated in place, so a refresh with 8 GPUs and 50 kernels only rewrites changed text.
 */
import { Message } from '@lumino/messaging';
import { Widget } from '@lumino/widgets';
import { LabIcon } from '@jupyterlab/ui-components';

import { IStatus } from './api';
import { Attr, CSS, WidgetIDs } from './ids';
import { el, setHidden, setText } from './dom';
import { efficiency } from './metrics';
import { formatDuration, formatGiBHours } from './format';
import { GPUCard } from './gpucard';
import { HubLine } from './hubline';
import { ChartLegend } from './legend';
import { IRowActions, KernelRow } from './kernelrow';
import { GPUShareModel } from './model';
import { ColorMap, kernelLabels, sortKernels } from './rules';

export interface IPanelOptions {
  model: GPUShareModel;
  icon: LabIcon;
  /** Open (or focus) a notebook by path. */
  open(path: string): void;
}

export class GPUSharePanel extends Widget {
  constructor(options: IPanelOptions) {
    super();
    this.id = WidgetIDs.panel;
    this.addClass(CSS.panel);
    this.title.icon = options.icon;
    this.title.caption = 'GPU sharing';
    this._model = options.model;
    this._open = options.open;

    const header = el('div', CSS.header);
    header.append(el('h2', `${CSS.header}-title`, 'GPU sharing'));
    this._summary = el('div', CSS.summary);
    header.append(this._summary);
    this._hub = new HubLine();
    header.append(this._hub.node);
    this._message = el('div', CSS.message);
    this._message.setAttribute('role', 'status');
    this._efficiency = el('div', CSS.efficiency);
    this._effValue = el('div', `${CSS.efficiency}-value`);
    this._efficiency.append(this._effValue);
    this._efficiency.title =
      'Held: GPU memory held by kernels, integrated over time. Used: the same, counting only ' +
      'the time the kernel holding it computed on that GPU (SM utilization above 0).';
    this._summary.title =
      "The server's idle_timeout, for kernels without their own; a kernel's own " +
      '(%gpushare idle-timeout, its kernelspec) shows in its row.';
    this._legend = new ChartLegend();
    this._gpuList = el('div', CSS.gpuList);
    this._kernelTitle = el('h3', `${CSS.kernelList}-title`, 'Kernels');
    this._kernelList = el('div', CSS.kernelList);
    this._noKernels = el('div', CSS.empty, 'No running kernels.');
    this.node.append(
      header,
      this._message,
      this._efficiency,
      this._legend.node,
      this._gpuList,
      this._kernelTitle,
      this._noKernels,
      this._kernelList
    );

    const model = this._model;
    this._actions = {
      open: path => this._open(path),
      release: id => void model.release(id),
      restore: id => void model.restore(id),
      setPinned: (id, pinned) => void model.setPinned(id, pinned)
    };
    model.changed.connect(this._onChanged, this);
  }

  /** Rebuild the charts' canvases with the new theme's colors. */
  themeChanged(): void {
    this._gpus.forEach(card => card.invalidate());
    this.update();
  }

  dispose(): void {
    if (this.isDisposed) {
      return;
    }
    this._placeToasts(false);
    this._model.changed.disconnect(this._onChanged, this);
    if (this._wantsHistory) {
      this._model.wantHistory(false);
    }
    this._gpus.forEach(card => card.dispose());
    super.dispose();
  }

  protected onAfterShow(msg: Message): void {
    if (!this._wantsHistory) {
      this._wantsHistory = true;
      this._model.wantHistory(true);
    }
    this._placeToasts(true);
    this.update();
  }

  protected onAfterHide(msg: Message): void {
    if (this._wantsHistory) {
      this._wantsHistory = false;
      this._model.wantHistory(false);
    }
    this._placeToasts(false);
  }

  protected onResize(msg: Widget.ResizeMessage): void {
    this._placeToasts(this.isVisible);
    this.update();
  }

  /**
   * The lab shows toasts at the bottom right, which is where this panel's kernel rows are
   * when it sits in the right sidebar: a "Released ..." toast would cover the very row it is
   * about. While the panel is open there, toasts move to its left (CSS in style/base.css).
   */
  private _placeToasts(visible: boolean): void {
    const body = document.body;
    const rect = this.node.getBoundingClientRect();
    const atRightEdge = visible && rect.width > 0 && window.innerWidth - rect.right < 80;
    if (atRightEdge) {
      const offset = `${Math.ceil(window.innerWidth - rect.left)}px`;
      if (body.style.getPropertyValue(TOAST_OFFSET) !== offset) {
        body.style.setProperty(TOAST_OFFSET, offset);
      }
      body.classList.add(CSS.toastsAside);
    } else {
      body.classList.remove(CSS.toastsAside);
      body.style.removeProperty(TOAST_OFFSET);
    }
  }

  protected onUpdateRequest(msg: Message): void {
    if (this.isVisible) {
      this.render();
    }
  }

  /** Render the model now (public so the benchmark can time one render). */
  render(): void {
    const model = this._model;
    const status = model.status;
    this._renderMessage(status);
    if (!status) {
      return;
    }
    this._hub.update(status.hub);
    const windowSeconds = model.historySeconds;
    setText(
      this._summary,
      `backend ${status.backend} · method ${status.method ?? '—'} · ` +
        (status.idle_timeout
          ? `idle timeout ${formatDuration(status.idle_timeout)} by default`
          : 'no automatic release by default')
    );

    const history = model.history;
    const order = sortKernels(status.kernels);
    // Assign colors in a stable order so chart areas and row swatches match.
    order.forEach(id => this._colors.color(id));

    // All charts share one width: measure it once, before any write, so the render does
    // not force a layout per card.
    const first = this._gpus.values().next().value as GPUCard | undefined;
    const chartWidth = first ? first.measure() : undefined;

    // GPU cards, keyed by index.
    const seenGpus = new Set<number>();
    const charted = new Set<string>();
    status.gpus.forEach((gpu, i) => {
      seenGpus.add(gpu.index);
      let card = this._gpus.get(gpu.index);
      if (!card) {
        card = new GPUCard(gpu.index, {
          color: id => this._colors.color(id),
          label: id => model.kernel(id)?.path ?? id
        });
        this._gpus.set(gpu.index, card);
      }
      if (this._gpuList.children[i] !== card.node) {
        this._gpuList.insertBefore(card.node, this._gpuList.children[i] ?? null);
      }
      card
        .update(gpu, history, order, windowSeconds, chartWidth || undefined)
        .forEach(id => charted.add(id));
    });
    for (const [index, card] of this._gpus) {
      if (!seenGpus.has(index)) {
        card.dispose();
        this._gpus.delete(index);
      }
    }

    // Kernels are named so that two notebooks never look alike, in the legend as in the rows.
    const labels = kernelLabels(status.kernels);
    this._legend.update(
      order
        .filter(id => charted.has(id))
        .map(id => ({ id, label: labels.get(id)!, color: this._colors.color(id) })),
      history !== null && status.gpus.length > 0
    );

    // Efficiency over the window, all GPUs together.
    if (history && status.gpus.length > 0) {
      const eff = efficiency(history.kernels, history.interval, history.now);
      const pct = eff.ratio === null ? '—' : `${Math.round(eff.ratio * 100)} %`;
      setText(
        this._effValue,
        `Efficiency, last ${formatDuration(windowSeconds)}: ${formatGiBHours(eff.usedByteSeconds)} used ` +
          `of ${formatGiBHours(eff.heldByteSeconds)} held (${pct})`
      );
      setHidden(this._efficiency, false);
    } else {
      setHidden(this._efficiency, true);
    }

    // Kernel rows, keyed by id, in `order`.
    const seen = new Set<string>();
    order.forEach((id, i) => {
      const kernel = status.kernels.find(k => k.id === id)!;
      seen.add(id);
      let row = this._rows.get(id);
      if (!row) {
        row = new KernelRow(id, this._actions);
        this._rows.set(id, row);
      }
      if (this._kernelList.children[i] !== row.node) {
        this._kernelList.insertBefore(row.node, this._kernelList.children[i] ?? null);
      }
      row.update({
        kernel,
        label: labels.get(id)!,
        utilization: history?.kernels[id]?.sm_utilization ?? [],
        color: this._colors.color(id),
        serverIdleTimeout: status.idle_timeout,
        pending: model.pendingAction(id),
        error: model.kernelError(id)
      });
    });
    for (const [id, row] of this._rows) {
      if (!seen.has(id)) {
        row.node.remove();
        this._rows.delete(id);
      }
    }
    setText(this._kernelTitle, `Kernels (${status.kernels.length})`);
    setHidden(this._noKernels, status.kernels.length > 0);
  }

  private _renderMessage(status: IStatus | null): void {
    const model = this._model;
    let message = '';
    let kind = 'info';
    if (model.error && !model.reachable) {
      message =
        'The jupyter-gpushare server extension does not answer. Is it installed and enabled ' +
        `on this server? (${model.error})`;
      kind = 'error';
    } else if (model.error) {
      message = `Could not refresh: ${model.error}`;
      kind = 'error';
    } else if (!status) {
      message = 'Loading…';
    } else if (!status.available) {
      message = `GPU telemetry unavailable: ${status.reason || 'no reason given'}`;
      kind = 'warning';
    } else if (status.gpus.length === 0) {
      message = 'No GPUs on this server.';
    }
    setText(this._message, message);
    this._message.setAttribute('data-kind', kind);
    setHidden(this._message, message === '');
  }

  private _onChanged(): void {
    this.update();
  }

  private _model: GPUShareModel;
  private _open: (path: string) => void;
  private _actions: IRowActions;
  private _summary: HTMLDivElement;
  private _hub: HubLine;
  private _message: HTMLDivElement;
  private _efficiency: HTMLDivElement;
  private _legend: ChartLegend;
  private _effValue: HTMLDivElement;
  private _gpuList: HTMLDivElement;
  private _kernelTitle: HTMLHeadingElement;
  private _kernelList: HTMLDivElement;
  private _noKernels: HTMLDivElement;
  private _gpus = new Map<number, GPUCard>();
  private _rows = new Map<string, KernelRow>();
  private _colors = new ColorMap();
  private _wantsHistory = false;
}

/** How far from the window's right edge toasts sit while the panel is open on the right. */
const TOAST_OFFSET = '--jp-gpushare-toast-offset';

/** Exposed for tests: the attribute that identifies kernel rows. */
export const KERNEL_ROW_SELECTOR = `.${CSS.kernel}[${Attr.kernelId}]`;
