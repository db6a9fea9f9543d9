/**
 * Which actions a kernel's state allows (pure), so buttons are disabled instead of failing. The
 * table is the server's own (`ALLOWED_IN`, generated from jupyter_gpushare/core/lifecycle.py), the
 * states the contract's (`KernelState`).
 */
import { ALLOWED_IN, IKernel, KernelAction, KernelState } from './contract';
import { distinctNames } from './format';

/** Whether the server takes each action in a state. */
export type IAllowed = { readonly [action in KernelAction]: boolean };

/**
 * Pinning is not part of it: a pinned kernel is never released *automatically*, and a person
 * may still release it by hand, as over REST and with `%gpushare release`. A restore may be
 * asked while a release runs (it waits for it) or a restore runs (it joins it); any kernel may
 * be pinned, an untracked one included.
 */
export function allowedActions(state: KernelState): IAllowed {
  return {
    release: ALLOWED_IN.release.includes(state),
    restore: ALLOWED_IN.restore.includes(state),
    pin: ALLOWED_IN.pin.includes(state)
  };
}

/** A categorical palette readable on light and dark themes (Tableau 10). */
export const PALETTE = [
  '#4e79a7',
  '#f28e2b',
  '#59a14f',
  '#e15759',
  '#76b7b2',
  '#edc948',
  '#b07aa1',
  '#ff9da7',
  '#9c755f',
  '#bab0ac'
];

/** Stable colors: a kernel keeps its color for as long as the page lives. */
export class ColorMap {
  color(id: string): string {
    let color = this._colors.get(id);
    if (color === undefined) {
      color = PALETTE[this._next % PALETTE.length];
      this._next++;
      this._colors.set(id, color);
    }
    return color;
  }

  private _colors = new Map<string, string>();
  private _next = 0;
}

/**
 * The name of each kernel's row: its notebook's file name with as many parent folders as it
 * takes to differ from the other kernels' notebooks; the kernelspec and the id's first
 * characters for a kernel without a notebook, or for two kernels on one notebook.
 */
export function kernelLabels(
  kernels: readonly Pick<IKernel, 'id' | 'name' | 'path'>[]
): Map<string, string> {
  const names = distinctNames(kernels.map(k => k.path).filter(p => p));
  const perPath = new Map<string, number>();
  kernels.forEach(k => perPath.set(k.path, (perPath.get(k.path) ?? 0) + 1));
  const labels = new Map<string, string>();
  for (const k of kernels) {
    const short = k.id.slice(0, 8);
    if (!k.path) {
      labels.set(k.id, k.name ? `${k.name} ${short}` : `kernel ${short}`);
    } else {
      const name = names.get(k.path) ?? k.path;
      labels.set(k.id, perPath.get(k.path)! > 1 ? `${name} (${short})` : name);
    }
  }
  return labels;
}

/** What a request the panel sent for a kernel is doing, while it is in flight. */
export type PendingAction = KernelAction;

/**
 * The state a kernel's row shows: the server's, except while a release or restore asked from
 * this page is in flight, when it shows "releasing"/"restoring" at once rather than the state
 * before the click until the request returns (and "release after … (in 1 min 49 s)"
 * meanwhile). A restore asked during a release shows "restoring": the server restores as soon
 * as the release ends.
 */
export function displayedState(state: KernelState, pending: PendingAction | null): KernelState {
  if (pending === 'release' && ALLOWED_IN.release.includes(state)) {
    return 'releasing';
  }
  if (pending === 'restore' && ALLOWED_IN.restore.includes(state)) {
    return 'restoring';
  }
  return state;
}

const collator = new Intl.Collator(undefined, { sensitivity: 'base', numeric: true });

/**
 * Kernel ids in row order: by notebook path as a person sorts names (case-insensitive,
 * "run2" before "run10"), then exactly (so "A.ipynb" and "a.ipynb" keep one order), then by
 * id. Stable between refreshes. Kernels without a notebook come last.
 */
export function sortKernels(kernels: readonly Pick<IKernel, 'id' | 'path'>[]): string[] {
  const exact = (a: string, b: string) => (a < b ? -1 : a > b ? 1 : 0);
  return [...kernels]
    .sort((a, b) => {
      const pa = a.path ?? '';
      const pb = b.path ?? '';
      if (!pa !== !pb) {
        return pa ? -1 : 1;
      }
      return collator.compare(pa, pb) || exact(pa, pb) || exact(a.id, b.id);
    })
    .map(k => k.id);
}
