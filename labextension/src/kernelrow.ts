/**
 * One kernel's row in the panel, created once per kernel id and updated in place.
 */
import { IKernel } from './api';
import { isAheadText } from './ahead';
import { allowedActions, displayedState, PendingAction } from './rules';
import { Attr, CSS } from './ids';
import { el, setAttr, setClauses, setDisabled, setHidden, setText, Sparkline } from './dom';
import { formatBytes, formatUtilization, splitForEllipsis, timingClauses } from './format';

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
  /** The server's idle_timeout (s): the row says when the kernel's own differs. */
  serverIdleTimeout: number;
  /** The request from this page in flight for the kernel, if any. */
  pending: PendingAction | null;
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
    // The name is cut in its middle, keeping its end (".ipynb", the kernel's id) in view.
    this._nameHead = el('span', `${CSS.kernelName}-head`);
    this._nameTail = el('span', `${CSS.kernelName}-tail`);
    this._name.append(this._nameHead, this._nameTail);
    this._badge = el('span', CSS.badge);
    this._pinBadge = el('span', `${CSS.badge} ${CSS.badge}-pinned`, 'pinned');
    // The badges go under the name, on the right, when both do not fit on one line.
    const badges = el('span', `${CSS.kernel}-badges`);
    badges.append(this._badge, this._pinBadge);
    head.append(this._swatch, this._name, badges);

    const usage = (this._usage = el('div', CSS.kernelStats));
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
    const { head, tail } = splitForEllipsis(view.label);
    setText(this._nameHead, head);
    setText(this._nameTail, tail);
    // Read as one word (flex items are read as separate ones: "gpushare- demo.ipynb").
    setAttr(this._name, 'aria-label', view.label);
    // The whole path on hover (the name may be cut short by the panel's width).
    setAttr(this._name, 'title', k.path ? `${k.path}\nkernel ${k.id}` : `kernel ${k.id}`);
    setAttr(this.node, 'data-path', k.path);
    // The state shown: "releasing…" from the click on, not the state before it.
    const state = displayedState(k.state, view.pending);
    setAttr(this.node, 'data-pending', view.pending);
    const busy = state === 'releasing' || state === 'restoring';
    setText(this._badge, busy ? `${state}…` : state);
    setAttr(this._badge, 'class', `${CSS.badge} ${CSS.badge}-${state}`);
    setHidden(this._pinBadge, !k.pinned);

    const gpus = k.gpus && k.gpus.length > 0 ? ` on GPU ${k.gpus.join(', ')}` : '';
    const memory =
      k.state === 'released'
        ? `${formatBytes(k.released_bytes)} on host`
        : `${formatBytes(k.gpu_memory_bytes)}${gpus}`;
    // a capped kernel: its cap per GPU beside what it holds
    const cap = typeof k.memory_cap === 'number' ? ` (cap ${formatBytes(k.memory_cap)})` : '';
    setText(this._memory, memory + cap);
    const util = formatUtilization(k);
    setText(this._util, util);
    // Per GPU ("SM 93 % on GPU 0 · 0 % on GPU 1"): a line of its own, under the memory.
    setAttr(this._usage, 'data-per-gpu', util.includes(' on GPU ') ? 'true' : null);
    this._spark.update(view.utilization);

    const parts = timingClauses(k, state, view.serverIdleTimeout);
    if (k.moved && (state === 'active' || state === 'idle')) {
      parts.push(`moved ${k.moved}`); // "GPU 0 -> 3: GPU 0 busy" (off a contended GPU)
    } else if (k.restored_onto && (state === 'active' || state === 'idle')) {
      parts.push(`restored ${k.restored_onto}`); // "onto GPU 1: GPU 0 had no room"
    }
    if (k.over_cap) {
      parts.push(k.over_cap); // "holds 9.1 GiB of its 8 GiB cap on GPU 0"
    }
    if (k.waiting) {
      // a restore ahead says what it does ("restoring ahead of your next cell")
      parts.push(isAheadText(k.waiting) ? k.waiting : `waiting: ${k.waiting}`);
    }
    const toCopy = k.to_copy_bytes;
    if (
      k.host_copy_bytes &&
      typeof toCopy === 'number' &&
      (state === 'active' || state === 'idle')
    ) {
      // a release copies only what changed since the kept host copy
      parts.push(`host copy ${formatBytes(k.host_copy_bytes)}, ${formatBytes(toCopy)} to copy`);
    }
    setClauses(this._timing, parts);

    const allowed = allowedActions(k.state);
    const pending = view.pending !== null;
    setDisabled(this._release, pending || !allowed.release);
    setDisabled(this._restore, pending || !allowed.restore);
    setDisabled(this._pin, pending || !allowed.pin);
    setAttr(
      this._release,
      'title',
      k.pinned
        ? "Move this kernel's GPU memory to host memory now (pinned only stops automatic releases)"
        : "Move this kernel's GPU memory to host memory now"
    );
    // A restore may be asked mid-release (it follows the release) or mid-restore (it joins it).
    setAttr(
      this._restore,
      'title',
      k.state === 'releasing'
        ? "Bring this kernel's GPU memory back as soon as the release ends"
        : k.state === 'restoring'
          ? 'A restore is under way; this waits for it to end'
          : "Bring this kernel's GPU memory back now"
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
  private _nameHead: HTMLSpanElement;
  private _nameTail: HTMLSpanElement;
  private _badge: HTMLSpanElement;
  private _pinBadge: HTMLSpanElement;
  private _usage: HTMLDivElement;
  private _memory: HTMLSpanElement;
  private _util: HTMLSpanElement;
  private _spark: Sparkline;
  private _timing: HTMLDivElement;
  private _release: HTMLButtonElement;
  private _restore: HTMLButtonElement;
  private _pin: HTMLButtonElement;
  private _error: HTMLDivElement;
}
