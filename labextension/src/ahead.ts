/**
 * Restores ahead of a person's next cell: when someone works in a notebook whose kernel is
 * released (it becomes the current notebook, a code cell of it is edited, a key or pointer is
 * pressed in it, or they come back to the page while it is the notebook in front), ask the
 * server to bring the kernel's GPU state back now (`POST .../restore` with
 * `{"trigger": "activity"}`), so that it is there before the cell is run. Pure: the caller
 * says when a person works and in which kernel; this decides whether to ask.
 */
import type { IKernel } from './contract';

/** What the server's `waiting` says while a restore ahead is on its way. */
export const AHEAD_TEXT = 'restoring ahead of your next cell';

/** At most one request per kernel in this many milliseconds. */
export const AHEAD_INTERVAL_MS = 5000;

/**
 * Whether a kernel is worth a restore ahead: released (not failed, not on its way back), and
 * not pinned (a person who pinned a released kernel keeps it off the GPU until a cell).
 */
export function aheadEligible(kernel: IKernel | undefined): boolean {
  return kernel !== undefined && kernel.state === 'released' && !kernel.pinned && !kernel.waiting;
}

/**
 * Presses inside a notebook that say its person is working in it: clicking into a cell or
 * its toolbar, typing, or the Shift of the Shift-Enter that runs a cell unedited (the most
 * common first act of someone back from a break, which no edit announces). Captured, so a
 * widget that stops them on the way does not hide them.
 */
export const NOTEBOOK_INPUT_EVENTS = ['pointerdown', 'keydown'] as const;

/**
 * Whether a page event means its person is back in front of the notebook: the page was
 * shown again (`visibilitychange` to `visible`) or the window took the focus, while a
 * notebook is the main area's current widget (not a terminal or an editor in front of it).
 */
export function backAtNotebook(
  type: string,
  visibility: DocumentVisibilityState | string,
  notebookInFront: boolean
): boolean {
  if (!notebookInFront) {
    return false;
  }
  if (type === 'visibilitychange') {
    return visibility === 'visible';
  }
  return type === 'focus';
}

/** True when the server's `waiting` text is that of a restore ahead. */
export function isAheadText(waiting: string | null | undefined): boolean {
  return !!waiting && waiting.startsWith(AHEAD_TEXT);
}

export interface IAheadOptions {
  /** The kernel as the last status showed it (undefined: not known yet, e.g. on page load). */
  kernel(id: string): IKernel | undefined;
  /** Send the request; failures are the caller's to log (a hint: nothing is retried). */
  send(id: string): Promise<unknown>;
  /** Milliseconds now (tests pass their own clock). */
  now?: () => number;
  intervalMs?: number;
}

/** Debounced restores ahead: at most one request per kernel per `intervalMs`. */
export class AheadRestorer {
  constructor(options: IAheadOptions) {
    this._options = options;
    this._now = options.now ?? (() => Date.now());
    this._interval = options.intervalMs ?? AHEAD_INTERVAL_MS;
  }

  /**
   * A person works in the notebook of kernel `id` (null: no kernel). Returns whether a
   * request was sent.
   */
  activity(id: string | null | undefined): boolean {
    if (!id || !aheadEligible(this._options.kernel(id))) {
      return false;
    }
    const now = this._now();
    const last = this._sent.get(id);
    if (last !== undefined && now - last < this._interval) {
      return false;
    }
    this._sent.set(id, now);
    this._options.send(id).catch(reason => {
      console.warn('jupyter-gpushare: could not ask for a restore ahead', reason);
    });
    return true;
  }

  /** Forget a kernel (it shut down). */
  forget(id: string): void {
    this._sent.delete(id);
  }

  private _options: IAheadOptions;
  private _now: () => number;
  private _interval: number;
  private _sent = new Map<string, number>();
}
