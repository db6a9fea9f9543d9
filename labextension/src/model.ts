/**
 * The shared client-side state: the latest status and history, refreshed by one Poll.
 *
 * The panel, the status bar item and the notifications all read this model, so the server
 * is asked once per refresh whatever is on screen. History (the heavier call) is fetched
 * only while a view asks for it (the panel is visible).
 */
import { Poll } from '@lumino/polling';
import { ISignal, Signal } from '@lumino/signaling';
import { IDisposable } from '@lumino/disposable';

import { GPUShareAPI, IHistory, IKernel, IStatus } from './api';
import { mergeHistory } from './metrics';

export interface IModelOptions {
  api: GPUShareAPI;
  /** Milliseconds between refreshes. */
  refreshInterval: number;
  /** Seconds of history the chart shows. */
  historySeconds: number;
}

/** Kernel-row errors expire so a stale message does not linger next to a working kernel. */
const ERROR_TTL_MS = 30_000;

/** Refetch the whole history window after this many incremental fetches. */
const FULL_HISTORY_EVERY = 150;

export class GPUShareModel implements IDisposable {
  constructor(options: IModelOptions) {
    this.api = options.api;
    this._historySeconds = options.historySeconds;
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

  refresh(): Promise<void> {
    return this._poll.refresh();
  }

  release(id: string): Promise<void> {
    return this._act(id, () => this.api.release(id));
  }

  restore(id: string): Promise<void> {
    return this._act(id, () => this.api.restore(id));
  }

  setPinned(id: string, pinned: boolean): Promise<void> {
    return this._act(id, () => this.api.pin(id, pinned));
  }

  dispose(): void {
    if (this._isDisposed) {
      return;
    }
    this._isDisposed = true;
    this._poll.dispose();
    Signal.clearData(this);
  }

  private async _act(id: string, request: () => Promise<IKernel>): Promise<void> {
    this._pending.add(id);
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
  }

  private async _refresh(): Promise<void> {
    try {
      const wantHistory = this._historyWanted > 0;
      const [status, history] = await Promise.all([
        this.api.status(),
        wantHistory ? this._fetchHistory() : Promise.resolve(null)
      ]);
      this._status = status;
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
    }
    this._changed.emit();
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
  private _historyFetchedAt = 0;
  private _historyWindow = 0;
  private _incrementalFetches = 0;
  private _status: IStatus | null = null;
  private _history: IHistory | null = null;
  private _error: string | null = null;
  private _reachable = true;
  private _historySeconds: number;
  private _historyWanted = 0;
  private _pending = new Set<string>();
  private _kernelErrors = new Map<string, { message: string; at: number }>();
  private _isDisposed = false;
  private _changed = new Signal<this, void>(this);
}
