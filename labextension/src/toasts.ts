/**
 * The text of each toast (pure: no JupyterLab), so it is unit-tested as written.
 */
import { IKernelEvent, RestoreMode } from './contract';
import { formatBytes, formatDuration } from './format';

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
          // the exception last: the lab cuts a toast at 140 characters
          `${why} (a cell of only %gpushare magics leaves it released).`
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
