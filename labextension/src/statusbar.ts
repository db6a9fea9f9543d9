/**
 * Status bar item for the current notebook's kernel: "GPU 1.2 GiB · 35 % SM",
 * "GPU released (4.0 GiB on host)", or a spinner while releasing/restoring.
 */
import { ISessionContext } from '@jupyterlab/apputils';
import { ISignal, Signal } from '@lumino/signaling';
import { Widget } from '@lumino/widgets';

import { IKernel } from './api';
import { CSS } from './ids';
import { formatBytes, formatPercent } from './format';
import { GPUShareModel } from './model';
import { displayedState } from './rules';
import { isAheadText } from './ahead';

/** The status text for a kernel, or null when there is nothing GPU-related to say. */
export function statusText(kernel: IKernel | undefined): { text: string; busy: boolean } | null {
  if (!kernel) {
    return null;
  }
  if (isAheadText(kernel.waiting)) {
    return { text: `GPU ${kernel.waiting}`, busy: true };
  }
  if (kernel.waiting) {
    // a restore waiting for memory keeps the kernel 'released' until bytes move
    return { text: `GPU restore waiting: ${kernel.waiting}`, busy: true };
  }
  switch (kernel.state) {
    case 'released':
      return { text: `GPU released (${formatBytes(kernel.released_bytes)} on host)`, busy: false };
    case 'releasing':
      return { text: 'GPU releasing…', busy: true };
    case 'restoring':
      return { text: 'GPU restoring…', busy: true };
    case 'failed':
      return { text: `GPU ${kernel.error ? `failed: ${kernel.error}` : 'failed'}`, busy: false };
    default:
      if (!kernel.gpu_memory_bytes && kernel.state === 'untracked') {
        return null;
      }
      return {
        // "SM": the figure is the kernel's SM utilization, not its share of memory
        text: `GPU ${formatBytes(kernel.gpu_memory_bytes ?? 0)} · ${formatPercent(kernel.sm_utilization)} SM`,
        busy: false
      };
  }
}

export class GPUStatusItem extends Widget {
  constructor(model: GPUShareModel, onClick: () => void) {
    super();
    this.addClass(CSS.statusItem);
    this.addClass('jp-StatusBar-TextItem');
    this._model = model;
    this._spinner = document.createElement('span');
    this._spinner.className = CSS.spinner;
    this._text = document.createElement('span');
    this.node.append(this._spinner, this._text);
    this.node.title = "GPU memory of this notebook's kernel (click for the GPU sharing panel)";
    this.node.addEventListener('click', onClick);
    model.changed.connect(this._refresh, this);
  }

  /** Emitted when the item starts or stops having something to show. */
  get activeChanged(): ISignal<this, void> {
    return this._activeChanged;
  }

  get isActiveItem(): boolean {
    return this._active;
  }

  /** The session whose kernel is shown (the current notebook's), or null. */
  setSession(session: ISessionContext | null): void {
    if (this._session === session) {
      return;
    }
    this._session?.kernelChanged.disconnect(this._refresh, this);
    this._session = session;
    session?.kernelChanged.connect(this._refresh, this);
    this._refresh();
  }

  dispose(): void {
    this._model.changed.disconnect(this._refresh, this);
    this._session?.kernelChanged.disconnect(this._refresh, this);
    super.dispose();
  }

  private _refresh(): void {
    const id = this._session?.session?.kernel?.id;
    const kernel = id ? this._model.kernel(id) : undefined;
    // "GPU releasing…" from the click on (panel or command), as the panel's row shows it.
    const shown = kernel && {
      ...kernel,
      state: displayedState(kernel.state, this._model.pendingAction(kernel.id))
    };
    const view = statusText(shown);
    const active = view !== null;
    if (view) {
      if (this._text.textContent !== view.text) {
        this._text.textContent = view.text;
      }
      this._spinner.hidden = !view.busy;
      this.node.dataset.busy = view.busy ? 'true' : 'false';
    }
    if (active !== this._active) {
      this._active = active;
      this._activeChanged.emit();
    }
  }

  private _model: GPUShareModel;
  private _session: ISessionContext | null = null;
  private _spinner: HTMLSpanElement;
  private _text: HTMLSpanElement;
  private _active = false;
  private _activeChanged = new Signal<this, void>(this);
}
