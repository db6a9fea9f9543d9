/**
 * Unit tests of the pure modules (formatting, efficiency, stacking, button rules).
 * Run with `jlpm test` (compiled to CommonJS, executed by `node --test`).
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import {
  baseName,
  formatBytes,
  formatDuration,
  formatGiBHours,
  formatPercent
} from '../src/format';
import { efficiency, IHistoryLike, mergeHistory, sampleAndHold, stackOnGPU } from '../src/metrics';
import { KernelState, KernelStateValues } from '../src/contract';
import { allowedActions, ColorMap, PALETTE } from '../src/rules';

const GiB = 1024 ** 3;

test('formatBytes picks binary units and marks unknown', () => {
  assert.equal(formatBytes(1.2 * GiB), '1.2 GiB');
  assert.equal(formatBytes(512 * 1024 ** 2), '512 MiB');
  assert.equal(formatBytes(2048), '2 KiB');
  assert.equal(formatBytes(12), '12 B');
  assert.equal(formatBytes(null), '—');
  assert.equal(formatBytes(Number.NaN), '—');
});

test('formatPercent and formatDuration', () => {
  assert.equal(formatPercent(34.6), '35 %');
  assert.equal(formatPercent(undefined), '—');
  assert.equal(formatDuration(0.42), '0.4 s');
  assert.equal(formatDuration(45), '45 s');
  assert.equal(formatDuration(130), '2 min 10 s');
  assert.equal(formatDuration(600), '10 min');
  assert.equal(formatDuration(3900), '1 h 5 min');
  assert.equal(formatDuration(-3), '0.0 s');
  assert.equal(formatDuration(null), '—');
});

test('formatGiBHours and baseName', () => {
  assert.equal(formatGiBHours(GiB * 3600), '1.00 GiB·h');
  assert.equal(formatGiBHours(GiB * 36), '0.010 GiB·h');
  assert.equal(baseName('a/b/c.ipynb'), 'c.ipynb');
  assert.equal(baseName(null), '');
});

test('efficiency counts bytes held and bytes held while utilized', () => {
  const kernels = {
    a: {
      t: [0, 10, 20, 30],
      gpu_memory_bytes: [GiB, GiB, GiB, GiB],
      sm_utilization: [0, 50, 0, null],
      gpu: { '0': [GiB, GiB, GiB, GiB] }
    },
    b: {
      t: [20, 30],
      gpu_memory_bytes: [2 * GiB, 0],
      sm_utilization: [100, 100],
      gpu: { '1': [2 * GiB, 0] }
    }
  };
  // a: 4 samples of 10 s (last bounded by interval 10, now 40) = 40 GiB·s held, 10 used.
  // b: 10 s of 2 GiB, utilized = 20 GiB·s held and used; its last sample holds 0.
  const all = efficiency(kernels, 10, 40);
  assert.equal(all.heldByteSeconds, 60 * GiB);
  assert.equal(all.usedByteSeconds, 30 * GiB);
  assert.equal(all.ratio, 0.5);
  const gpu0 = efficiency(kernels, 10, 40, '0');
  assert.equal(gpu0.heldByteSeconds, 40 * GiB);
  assert.equal(gpu0.ratio, 0.25);
  // The last sample counts only up to `now`.
  assert.equal(efficiency(kernels, 10, 33, '0').heldByteSeconds, 33 * GiB);
  assert.equal(efficiency({}, 1, 0).ratio, null);
});

test('sampleAndHold holds the latest sample for at most maxGap seconds', () => {
  assert.deepEqual(sampleAndHold([0, 1, 2, 3, 10], [1, 2], [5, 7], 2), [0, 5, 7, 7, 0]);
  assert.deepEqual(sampleAndHold([0, 1], [], [], 2), [0, 0]);
  assert.deepEqual(sampleAndHold([0, 1], [0, 1], [null, 3], 2), [0, 3]);
});

test('stackOnGPU stacks in order and leaves out kernels holding nothing there', () => {
  const x = [0, 1, 2];
  const kernels = {
    a: { t: x, gpu_memory_bytes: [1, 1, 1], sm_utilization: [0, 0, 0], gpu: { '0': [1, 1, 1] } },
    b: { t: x, gpu_memory_bytes: [2, 2, 0], sm_utilization: [0, 0, 0], gpu: { '0': [2, 2, 0] } },
    c: { t: x, gpu_memory_bytes: [4, 4, 4], sm_utilization: [0, 0, 0], gpu: { '1': [4, 4, 4] } }
  };
  const stack = stackOnGPU(x, kernels, ['b', 'a', 'c', 'missing'], '0', 2);
  assert.deepEqual(stack.ids, ['b', 'a']);
  assert.deepEqual(stack.cumulative, [
    [2, 2, 0],
    [3, 3, 1]
  ]);
});

test('allowedActions follows the state machine; pinning never blocks a release by hand', () => {
  const resident = new Set<KernelState>(['active', 'idle']);
  const held = new Set<KernelState>(['released', 'failed']);
  for (const state of KernelStateValues) {
    assert.deepEqual(
      allowedActions(state),
      { release: resident.has(state), restore: held.has(state), pin: state !== 'untracked' },
      state
    );
  }
  assert.deepEqual(allowedActions('idle'), { release: true, restore: false, pin: true });
  assert.deepEqual(allowedActions('restoring'), { release: false, restore: false, pin: true });
});

test('ColorMap keeps a color per kernel', () => {
  const colors = new ColorMap();
  const a = colors.color('a');
  assert.equal(colors.color('b'), PALETTE[1]);
  assert.equal(colors.color('a'), a);
});

test('mergeHistory appends new samples, pads new GPU series and trims the window', () => {
  const base: IHistoryLike = {
    now: 3,
    interval: 1,
    gpus: { '0': { t: [1, 2, 3], memory_used: [1, 2, 3], utilization: [0, 0, 0] } },
    kernels: {
      k: {
        t: [1, 2, 3],
        gpu_memory_bytes: [1, 1, 1],
        sm_utilization: [0, 0, 0],
        gpu: { '0': [1, 1, 1] }
      },
      gone: { t: [1], gpu_memory_bytes: [5], sm_utilization: [0], gpu: { '0': [5] } }
    }
  };
  const fresh: IHistoryLike = {
    now: 5,
    interval: 1,
    gpus: {
      '0': { t: [3, 4, 5], memory_used: [3, 4, 5], utilization: [0, 50, 0] },
      '1': { t: [4, 5], memory_used: [7, 7], utilization: [1, 1] }
    },
    kernels: {
      k: {
        t: [3, 4, 5],
        gpu_memory_bytes: [1, 2, 2],
        sm_utilization: [0, 9, 9],
        gpu: { '0': [1, 1, 1], '1': [0, 1, 1] }
      }
    }
  };
  const merged = mergeHistory(base, fresh, 3);
  assert.equal(merged, base);
  assert.equal(merged.now, 5);
  // Window 3 s before now=5: samples at t >= 2 stay.
  assert.deepEqual(merged.gpus['0'], {
    t: [2, 3, 4, 5],
    memory_used: [2, 3, 4, 5],
    utilization: [0, 0, 50, 0]
  });
  assert.deepEqual(merged.gpus['1'].t, [4, 5]);
  assert.deepEqual(merged.kernels.k.t, [2, 3, 4, 5]);
  assert.deepEqual(merged.kernels.k.gpu_memory_bytes, [1, 1, 2, 2]);
  assert.deepEqual(merged.kernels.k.gpu, { '0': [1, 1, 1, 1], '1': [null, null, 1, 1] });
  // A kernel whose samples all left the window is dropped.
  assert.equal('gone' in merged.kernels, false);
});
