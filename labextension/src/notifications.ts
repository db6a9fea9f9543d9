/**
 * Toasts for this server's kernels from the jupyter_events stream (pushed by the server,
 * not polled): released, restored, a restore waiting for memory, and failures.
 */
import { Notification } from '@jupyterlab/apputils';
import { Event } from '@jupyterlab/services';
import { DisposableDelegate, IDisposable } from '@lumino/disposable';

import { IKernelEvent, KERNEL_EVENT_SCHEMA_ID } from './contract';
import { GPUShareModel } from './model';
import { kernelLabels } from './rules';
import { describeEvent } from './toasts';

/** The id of the events this module reads (`IKernelEvent`, generated from that schema). */
export const EVENT_SCHEMA_ID = KERNEL_EVENT_SCHEMA_ID;

export interface INotifierOptions {
  stream: Event.Stream;
  model: GPUShareModel;
  /** Whether toasts are on (the `notifications` setting); read at each event. */
  enabled(): boolean;
  openPanel(): void;
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
