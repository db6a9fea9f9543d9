/**
 * Toasts for this server's kernels from the jupyter_events stream (pushed by the server,
 * not polled): released, restored, a restore waiting for memory, and failures.
 */
import { Notification } from '@jupyterlab/apputils';
import { Event } from '@jupyterlab/services';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';

import { IKernelEvent, KERNEL_EVENT_SCHEMA_ID, RestoreMode } from './contract';
import { formatBytes, formatDuration } from './format';
import { GPUShareModel } from './model';
import { kernelLabels } from './rules';

/** The id of the events this module reads (`IKernelEvent`, generated from that schema). */
export const EVENT_SCHEMA_ID = KERNEL_EVENT_SCHEMA_ID;

export interface INotifierOptions {
  stream: Event.Stream;
  model: GPUShareModel;
  /** Whether toasts are on (the `notifications` setting); read at each event. */
  enabled(): boolean;
  openPanel(): void;
}

/**
 * The toast for an event, or null for events that need none (pin/unpin: the user did it).
 * `name` is the kernel's name as its panel row shows it; `restoreMode` the server's (what
 * brings a released kernel back: any cell in eager mode, a cell that may use the GPU in lazy
 * mode). The lab cuts toasts at 140 characters, so what matters comes first.
 */
export function describeEvent(
  event: IKernelEvent,
  name: string,
  restoreMode: RestoreMode = 'eager'
): { type: 'info' | 'success' | 'warning' | 'error'; message: string } | null {
  const bytes = event.bytes ? formatBytes(event.bytes) : null;
  const took =
    event.seconds !== null && event.seconds !== undefined
      ? ` in ${formatDuration(event.seconds)}`
      : '';
  const why = event.reason ? ` (${event.reason})` : '';
  if (event.trigger === 'activity' && event.action !== 'restored') {
    // a restore ahead of a cell is a hint: its wait or failure shows in the panel row, and
    // the cell restores as it would without it
    return null;
  }
  switch (event.action) {
    case 'released':
      return {
        type: 'info',
        message:
          `Released ${bytes ?? 'the'} GPU memory of ${name} to host memory; it comes back ` +
          (restoreMode === 'lazy' ? 'before the next GPU cell' : 'before the next cell') +
          `${why}.`
      };
    case 'restored':
      return {
        type: 'success',
        message:
          `Restored ${bytes ?? 'the'} GPU memory of ${name}${took}` +
          (event.reason === 'activity' ? ', ahead of your next cell.' : '.')
      };
    case 'restore_waiting':
      return {
        type: 'warning',
        message: `${name} waits for GPU memory to restore${why}.`
      };
    case 'release_failed':
      return { type: 'error', message: `Could not release the GPU memory of ${name}${why}.` };
    case 'restore_failed':
      return { type: 'error', message: `Could not restore the GPU memory of ${name}${why}.` };
    default:
      return null;
  }
}

export function connectNotifications(options: INotifierOptions): IDisposable {
  const { stream, model } = options;
  const onEvent = (_: unknown, emission: Event.Emission) => {
    if (emission.schema_id !== EVENT_SCHEMA_ID) {
      return;
    }
    const event = emission as unknown as IKernelEvent;
    // (The model refreshes on the same events itself: GPUShareModel.followEvents.)
    if (!options.enabled()) {
      return;
    }
    // Named as in the panel: as much of the path as tells it from the other kernels.
    const kernels = model.status?.kernels ?? [];
    const name =
      kernelLabels(kernels).get(event.kernel_id) ?? `kernel ${String(event.kernel_id).slice(0, 8)}`;
    const toast = describeEvent(event, name, model.status?.restore_mode);
    if (!toast) {
      return;
    }
    Notification.emit(toast.message, toast.type, {
      autoClose: toast.type === 'error' ? false : 5000,
      actions: [{ label: 'GPU panel', callback: () => options.openPanel() }]
    });
  };
  stream.connect(onEvent);
  return new DisposableDelegate(() => stream.disconnect(onEvent));
}
