/**
 * One kernel's row in the panel, created once per kernel id and updated in place.
 */
import { IKernel } from './api';
import { allowedActions } from './rules';
import { Attr, CSS } from './ids';
import { el, setAttr, setDisabled, setHidden, setText, Sparkline } from './dom';
import { formatBytes, formatDuration, formatUtilization } from './format';

export interface IRowActions {
  open(path: string): void;
  release(id: string): void;
  restore(id: string): void;
  setPinned(id: string, pinned: boolean): void;
}

export interface IRowView {
  kernel: IKernel;
  /** The name shown: the notebook's file name, with as much of its path as tells it apart. */
  label: string;
  /** The kernel's SM utilization history, oldest first. */
  utilization: (number | null)[];
  color: string;
  pending: boolean;
  error: string | null;
}

export class KernelRow {
  constructor(id: string, actions: IRowActions) {
    this.id = id;
    this._actions = actions;
    const node = (this.node = el('div', CSS.kernel));
    node.setAttribute(Attr.kernelId, id);

    const head = el('div', `${CSS.kernel}-head`);
    this._swatch = el('span', `${CSS.kernel}-swatch`);
    this._name = el('a', CSS.kernelName);
    this._name.href = '#';
    this._name.addEventListener('click', event => {
      event.preventDefault();
      if (this._path) {
        this._actions.open(this._path);
      }
    });
    this._badge = el('span', CSS.badge);
    this._pinBadge = el('span', `${CSS.badge} ${CSS.badge}-pinned`, 'pinned');
    head.append(this._swatch, this._name, this._badge, this._pinBadge);

    const usage = el('div', CSS.kernelStats);
    this._memory = el('span', `${CSS.kernelStats}-memory`);
    this._util = el('span', `${CSS.kernelStats}-util`);
    this._spark = new Sparkline(CSS.sparkline);
    usage.append(this._memory, this._util, this._spark.node);

    this._timing = el('div', `${CSS.kernelStats} ${CSS.kernelStats}-timing`);

    const buttons = el('div', CSS.actions);
    this._release = this._button(
      'release',
      'Release',
      "Move this kernel's GPU memory to host memory now"
    );
    this._restore = this._button('restore', 'Restore', "Bring this kernel's GPU memory back now");
    this._pin = this._button('pin', 'Pin', 'A pinned kernel is never released automatically');
    buttons.append(this._release, this._restore, this._pin);

    this._error = el('div', CSS.kernelError);
    this._error.setAttribute('role', 'alert');
    node.append(head, usage, this._timing, buttons, this._error);
  }

  readonly id: string;
  readonly node: HTMLDivElement;

  update(view: IRowView): void {
    const k = view.kernel;
    this._kernel = k;
    this._path = k.path;
    setAttr(this.node, Attr.state, k.state);
    setAttr(this.node, 'data-gpu-memory-bytes', String(k.gpu_memory_bytes ?? 0));
    setAttr(this.node, 'data-pinned', k.pinned ? 'true' : 'false');
    if (this._color !== view.color) {
      this._color = view.color;
      this._swatch.style.background = view.color;
    }
    setText(this._name, view.label);
    // The whole path on hover (the name may be cut short by the panel's width).
    setAttr(this._name, 'title', k.path ? `${k.path}\nkernel ${k.id}` : `kernel ${k.id}`);
    setAttr(this.node, 'data-path', k.path);
    const busy = k.state === 'releasing' || k.state === 'restoring';
    setText(this._badge, busy ? `${k.state}…` : k.state);
    setAttr(this._badge, 'class', `${CSS.badge} ${CSS.badge}-${k.state}`);
    setHidden(this._pinBadge, !k.pinned);

    const gpus = k.gpus && k.gpus.length > 0 ? ` on GPU ${k.gpus.join(', ')}` : '';
    const memory =
      k.state === 'released'
        ? `${formatBytes(k.released_bytes)} on host`
        : `${formatBytes(k.gpu_memory_bytes)}${gpus}`;
    setText(this._memory, memory);
    setText(this._util, formatUtilization(k));
    this._spark.update(view.utilization);

    const parts: string[] = [];
    if (k.idle_seconds !== null && k.idle_seconds !== undefined) {
      parts.push(`idle ${formatDuration(k.idle_seconds)}`);
    }
    if (k.state === 'active' || k.state === 'idle') {
      if (k.pinned) {
        parts.push('never released automatically');
      } else if (k.release_in_seconds !== null && k.release_in_seconds !== undefined) {
        parts.push(`release in ${formatDuration(k.release_in_seconds)}`);
      } else {
        parts.push('no automatic release');
      }
    }
    if (k.method) {
      parts.push(`method ${k.method}`);
    }
    if (k.last_restore_seconds !== null && k.last_restore_seconds !== undefined) {
      parts.push(`last restore ${formatDuration(k.last_restore_seconds)}`);
    }
    if (k.waiting) {
      parts.push(`waiting: ${k.waiting}`);
    }
    setText(this._timing, parts.join(' · '));

    const allowed = allowedActions(k.state);
    setDisabled(this._release, view.pending || !allowed.release);
    setDisabled(this._restore, view.pending || !allowed.restore);
    setDisabled(this._pin, view.pending || !allowed.pin);
    setAttr(
      this._release,
      'title',
      k.pinned
        ? "Move this kernel's GPU memory to host memory now (pinned only stops automatic releases)"
        : "Move this kernel's GPU memory to host memory now"
    );
    setText(this._pin, k.pinned ? 'Unpin' : 'Pin');
    setAttr(this._pin, 'aria-pressed', k.pinned ? 'true' : 'false');

    const error = view.error ?? k.error ?? '';
    setText(this._error, error);
    setHidden(this._error, error === '');
  }

  private _button(action: string, label: string, title: string): HTMLButtonElement {
    const button = el('button', `${CSS.button} jp-mod-styled`, label);
    button.type = 'button';
    button.title = title;
    button.setAttribute(Attr.action, action);
    button.addEventListener('click', () => {
      const k = this._kernel;
      if (!k) {
        return;
      }
      if (action === 'release') {
        this._actions.release(k.id);
      } else if (action === 'restore') {
        this._actions.restore(k.id);
      } else {
        this._actions.setPinned(k.id, !k.pinned);
      }
    });
    return button;
  }

  private _actions: IRowActions;
  private _kernel: IKernel | null = null;
  private _path: string | null = null;
  private _color = '';
  private _swatch: HTMLSpanElement;
  private _name: HTMLAnchorElement;
  private _badge: HTMLSpanElement;
  private _pinBadge: HTMLSpanElement;
  private _memory: HTMLSpanElement;
  private _util: HTMLSpanElement;
  private _spark: Sparkline;
  private _timing: HTMLDivElement;
  private _release: HTMLButtonElement;
  private _restore: HTMLButtonElement;
  private _pin: HTMLButtonElement;
  private _error: HTMLDivElement;
}
