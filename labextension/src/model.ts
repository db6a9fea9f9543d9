/**
 * The shared client-side state: the latest status and history, refreshed by one Poll.
 *
 * The panel, the status bar item and the notifications all read this model, so the server
 * is asked once per refresh whatever is on screen. History (the heavier call) is fetched
 * only while a view asks for it (the panel is visible).
 */
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';

import type { GPUShareAPI } from './api';
import type { IHistory, IKernel, IStatus } from './contract';
import { mergeHistory } from './metrics';
import type { PendingAction } from './rules';

export interface IModelOptions {
  api: GPUShareAPI;
  /** Milliseconds between refreshes. */
  refreshInterval: number;
  /** Seconds of history the chart shows. */
  historySeconds: number;
}

/** Kernel-row errors expire so a stale message does not linger next to a working kernel. */
const ERROR_TTL_MS = 30_000;

/**
 * While a kernel is releasing or restoring, refresh this often (ms) until it is done: the
 * server's event for the end of a move can come just before its status says so.
 */
const TRANSITION_REFRESH_MS = 500;

/** Refetch the whole history window after this many incremental fetches. */
const FULL_HISTORY_EVERY = 150;

export class GPUShareModel implements IDisposable {
  constructor(options: IModelOptions) {
    this.api = options.api;
    this._historySeconds = options.historySeconds;
    this._interval = options.refreshInterval;
    this._poll = new Poll({
      auto: true,
      factory: () => this._refresh(),
      frequency: { interval: options.refreshInterval, backoff: true, max: 60_000 },
      name: 'jupyter-gpushare:model',
      standby: 'when-hidden'
    });
  }

  readonly api: GPUShareAPI;

  /** Emitted after every refresh (successful or not) and after an action changes state. */
  get changed(): ISignal<this, void> {
    return this._changed;
  }

  get status(): IStatus | null {
    return this._status;
  }

  get history(): IHistory | null {
    return this._history;
  }

  /** The last refresh's error message, or null when the last refresh worked. */
  get error(): string | null {
    return this._error;
  }

  /** Whether the server answered at all (false: extension not installed on the server). */
  get reachable(): boolean {
    return this._reachable;
  }

  get historySeconds(): number {
    return this._historySeconds;
  }

  get isDisposed(): boolean {
    return this._isDisposed;
  }

  /** Count of views that need history; history is fetched while it is above 0. */
  wantHistory(want: boolean): void {
    this._historyWanted = Math.max(0, this._historyWanted + (want ? 1 : -1));
    if (want && this._history === null) {
      void this.refresh();
    }
  }

  configure(refreshInterval: number, historySeconds: number): void {
    this._historySeconds = historySeconds;
    this._interval = refreshInterval;
    this._poll.frequency = { interval: refreshInterval, backoff: true, max: 60_000 };
  }

  kernel(id: string): IKernel | undefined {
    return this._status?.kernels.find(k => k.id === id);
  }

  /** An inline error for a kernel row (set when a release/restore/pin request fails). */
  kernelError(id: string): string | null {
    const entry = this._kernelErrors.get(id);
    if (!entry) {
      return null;
    }
    if (Date.now() - entry.at > ERROR_TTL_MS) {
      this._kernelErrors.delete(id);
      return null;
    }
    return entry.message;
  }

  /** Whether a request for this kernel is in flight (buttons stay disabled meanwhile). */
  isPending(id: string): boolean {
    return this._pending.has(id);
  }

  /** The request in flight for this kernel, if any (its row shows "releasing…" meanwhile). */
  pendingAction(id: string): PendingAction | null {
    return this._pending.get(id) ?? null;
  }

  /**
   * Ask the server for status (and history) now rather than at the next poll: after an
   * action, on a server event. `Poll.refresh()` does nothing while a refresh's request is
   * on its way, and a request that left before the change would bring the old state back,
   * so while one is in flight another follows as soon as it is back.
   */
  refresh(): Promise<void> {
    if (this._fetching) {
      this._again = true;
      return Promise.resolve();
    }
    return this._poll.refresh();
  }

  /**
   * Refresh on each of the server's kernel events (released, restored, pinned...), pushed
   * over jupyter_server's event bus (`/api/events/subscribe`, which JupyterLab's event
   * manager keeps open): the panel follows a release made elsewhere (a magic, the idle
   * timeout, REST) at once instead of at the next poll.
   */
  followEvents(stream: ISignal<unknown, { schema_id: string }>, schemaId: string): IDisposable {
    const onEvent = (_: unknown, emission: { schema_id: string }) => {
      if (emission.schema_id === schemaId) {
        void this.refresh();
      }
    };
    stream.connect(onEvent);
    return new DisposableDelegate(() => stream.disconnect(onEvent));
  }

  release(id: string): Promise<void> {
    return this._act(id, 'release', () => this.api.release(id));
  }

  restore(id: string): Promise<void> {
    return this._act(id, 'restore', () => this.api.restore(id));
  }

  setPinned(id: string, pinned: boolean): Promise<void> {
    return this._act(id, 'pin', () => this.api.pin(id, pinned));
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    clearTimeout(this._followUp);
    void this._poll.stop(); // Poll.dispose() leaves the next tick's timer running
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _act(
    id: string,
    action: PendingAction,
    request: () => Promise<IKernel>
  ): Promise<void> {
    this._pending.set(id, action);
    this._kernelErrors.delete(id);
    this._changed.emit();
    try {
      const kernel = await request();
      this._mergeKernel(kernel);
    } catch (error) {
      this._kernelErrors.set(id, {
        message: String((error as Error).message ?? error),
        at: Date.now()
      });
    } finally {
      this._pending.delete(id);
      this._changed.emit();
      void this.refresh();
    }
  }

  /** Apply the kernel object an action returned, so the row changes before the next poll. */
  private _mergeKernel(kernel: IKernel | null): void {
    if (!this._status || !kernel || typeof kernel !== 'object' || !kernel.id) {
      return;
    }
    const kernels = this._status.kernels.map(k => (k.id === kernel.id ? { ...k, ...kernel } : k));
    this._status = { ...this._status, kernels };
    // A status request on its way left before this answer: it must not undo it.
    this._generation++;
  }

  private async _refresh(): Promise<void> {
    const generation = this._generation;
    this._fetching = true;
    try {
      const wantHistory = this._historyWanted > 0;
      const [status, history] = await Promise.all([
        this.api.status(),
        wantHistory ? this._fetchHistory() : Promise.resolve(null)
      ]);
      if (generation === this._generation) {
        this._status = status;
        this._followTransitions(status);
      } else {
        this._again = true; // older than an action's answer: ask again rather than go back
      }
      if (history) {
        this._history = history;
      }
      this._error = null;
      this._reachable = true;
    } catch (error) {
      const status = (error as { status?: number }).status;
      this._reachable = status !== undefined && status !== 404;
      this._error = String((error as Error).message ?? error);
      this._changed.emit();
      // Rethrow so the Poll backs off while the server is unreachable.
      throw error;
    } finally {
      this._fetching = false;
      if (this._again) {
        this._again = false;
        // After the Poll has taken this tick's outcome (a refresh now would be dropped).
        setTimeout(() => {
          if (!this._isDisposed) {
            void this.refresh();
          }
        }, 0);
      }
    }
    this._changed.emit();
  }

  /** Refresh again soon while a kernel is releasing or restoring (see TRANSITION_REFRESH_MS). */
  private _followTransitions(status: IStatus): void {
    const moving = status.kernels.some(k => k.state === 'releasing' || k.state === 'restoring');
    if (!moving || this._interval <= TRANSITION_REFRESH_MS || this._followUp !== undefined) {
      return;
    }
    this._followUp = setTimeout(() => {
      this._followUp = undefined;
      if (!this._isDisposed) {
        void this.refresh();
      }
    }, TRANSITION_REFRESH_MS);
  }

  /**
   * The whole window on the first fetch (and now and then, to stay exact), otherwise only the
   * seconds since the last fetch, merged in: a 50-kernel, 10-minute window is megabytes of
   * JSON that the server would serialize and the page parse on every refresh.
   */
  private async _fetchHistory(): Promise<IHistory> {
    const window = this._historySeconds;
    const previous = this._history;
    const now = Date.now() / 1000;
    const elapsed = now - this._historyFetchedAt;
    const full =
      previous === null ||
      this._historyWindow !== window ||
      this._incrementalFetches >= FULL_HISTORY_EVERY ||
      elapsed > window / 2;
    const seconds = full ? window : Math.min(window, elapsed + Math.max(2, 3 * previous!.interval));
    const fresh = await this.api.history(seconds);
    this._historyFetchedAt = now;
    if (full) {
      this._incrementalFetches = 0;
      this._historyWindow = window;
      return fresh;
    }
    this._incrementalFetches++;
    return mergeHistory(previous!, fresh, window);
  }

  private _poll: Poll;
  private _interval: number;
  private _followUp: ReturnType<typeof setTimeout> | undefined = undefined;
  private _historyFetchedAt = 0;
  private _historyWindow = 0;
  private _incrementalFetches = 0;
  private _status: IStatus | null = null;
  private _history: IHistory | null = null;
  private _error: string | null = null;
  private _reachable = true;
  private _historySeconds: number;
  private _historyWanted = 0;
  private _pending = new Map<string, PendingAction>();
  /** Whether a status request is on its way, and whether another must follow it. */
  private _fetching = false;
  private _again = false;
  /** Counts local changes to `_status` (an action's answer) that a poll must not undo. */
  private _generation = 0;
  private _kernelErrors = new Map<string, { message: string; at: number }>();
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
}
