/**
 * Unit tests of the pure modules (formatting, efficiency, stacking, button rules, row names).
 * Run with `jlpm test` (compiled to CommonJS, executed by `node --test`).
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import {
  distinctNames,
  formatBytes,
  formatDuration,
  formatGiBHours,
  formatPercent,
  formatUtilization
} from '../src/format';
import {
  efficiency,
  IHistoryLike,
  mergeHistory,
  peak,
  sampleAndHold,
  slotPeaks,
  stackOnGPU
} from '../src/metrics';
import { ALLOWED_IN, KernelState, KernelStateValues } from '../src/contract';
import { allowedActions, ColorMap, IAllowed, kernelLabels, PALETTE } from '../src/rules';

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

test('formatUtilization shows each GPU when the kernel holds memory on several', () => {
  assert.equal(formatUtilization({ sm_utilization: 35, gpu_utilization: { '0': 35 } }), 'SM 35 %');
  assert.equal(formatUtilization({ sm_utilization: null, gpu_utilization: {} }), 'SM —');
  assert.equal(
    formatUtilization({ sm_utilization: 93, gpu_utilization: { '0': 93, '1': 0 } }),
    'SM 93 % on GPU 0 · 0 % on GPU 1'
  );
});

test('formatDuration carries rounding into the larger unit', () => {
  // Each was shown as "60 s", "1 min 60 s", "1 h 60 min" or "10.0 s".
  assert.equal(formatDuration(59.6), '1 min');
  assert.equal(formatDuration(119.6), '2 min');
  assert.equal(formatDuration(179.5), '3 min');
  assert.equal(formatDuration(7199), '2 h');
  assert.equal(formatDuration(3599.6), '1 h');
  assert.equal(formatDuration(9.97), '10 s');
  assert.equal(formatDuration(9.94), '9.9 s');
  assert.equal(formatDuration(89.4), '1 min 29 s');
  assert.equal(formatDuration(3630), '1 h 1 min');
  for (let s = 0; s < 4 * 3600; s += 0.7) {
    const text = formatDuration(s);
    assert.ok(!/\b60 (s|min)/.test(text), `${s} -> ${text}`);
    assert.ok(!/^10\.0 s/.test(text), `${s} -> ${text}`);
  }
});

test('formatGiBHours', () => {
  assert.equal(formatGiBHours(GiB * 3600), '1.00 GiB·h');
  assert.equal(formatGiBHours(GiB * 36), '0.010 GiB·h');
});

test('distinctNames keeps as much of a path as it takes to tell notebooks apart', () => {
  const names = distinctNames([
    'proj/a/train.ipynb',
    'proj/b/train.ipynb',
    'eval.ipynb',
    'x/y/eval2.ipynb',
    'one/two/same.ipynb',
    'three/two/same.ipynb',
    'train.ipynb',
    'proj/a/train.ipynb'
  ]);
  assert.equal(names.get('proj/a/train.ipynb'), 'a/train.ipynb');
  assert.equal(names.get('proj/b/train.ipynb'), 'b/train.ipynb');
  assert.equal(names.get('train.ipynb'), 'train.ipynb');
  assert.equal(names.get('eval.ipynb'), 'eval.ipynb');
  assert.equal(names.get('x/y/eval2.ipynb'), 'eval2.ipynb');
  assert.equal(names.get('one/two/same.ipynb'), 'one/two/same.ipynb');
  assert.equal(names.get('three/two/same.ipynb'), 'three/two/same.ipynb');
  const shown = [...names.values()];
  assert.equal(new Set(shown).size, shown.length); // every distinct path, a distinct name
  assert.deepEqual([...distinctNames(['a/n.ipynb']).values()], ['n.ipynb']);
  assert.deepEqual([...distinctNames([]).values()], []);
});

test('efficiency counts bytes held and bytes held while utilized', () => {
  const kernels = {
    a: {
      t: [0, 10, 20, 30],
      gpu_memory_bytes: [GiB, GiB, GiB, GiB],
      sm_utilization: [0, 50, 0, null],
      gpu: { '0': [GiB, GiB, GiB, GiB] },
      gpu_utilization: { '0': [0, 50, 0, null] }
    },
    b: {
      t: [20, 30],
      gpu_memory_bytes: [2 * GiB, 0],
      sm_utilization: [100, 100],
      gpu: { '1': [2 * GiB, 0] },
      gpu_utilization: { '1': [100, 100] }
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

test('efficiency counts a GPU as used only while the kernel computed on that GPU', () => {
  // One kernel, 1 GiB on each of two GPUs for 30 s, computing on GPU 0 the whole time and
  // never on GPU 1: its overall utilization (93 %) says nothing about GPU 1.
  const kernels = {
    k: {
      t: [0, 10, 20],
      gpu_memory_bytes: [2 * GiB, 2 * GiB, 2 * GiB],
      sm_utilization: [93, 93, 93],
      gpu: { '0': [GiB, GiB, GiB], '1': [GiB, GiB, GiB] },
      gpu_utilization: { '0': [93, 93, 93], '1': [0, 0, 0] }
    }
  };
  assert.equal(efficiency(kernels, 10, 30, '0').ratio, 1);
  assert.equal(efficiency(kernels, 10, 30, '1').ratio, 0);
  assert.equal(efficiency(kernels, 10, 30, '1').heldByteSeconds, 30 * GiB);
  const all = efficiency(kernels, 10, 30);
  assert.equal(all.heldByteSeconds, 60 * GiB);
  assert.equal(all.ratio, 0.5);
  // A series without per-GPU utilization counts as not computing, never as the overall figure.
  const { gpu_utilization: _, ...bare } = kernels.k;
  assert.equal(efficiency({ k: bare }, 10, 30, '1').ratio, 0);
});

test('sampleAndHold holds the latest sample for at most maxGap seconds', () => {
  assert.deepEqual(sampleAndHold([0, 1, 2, 3, 10], [1, 2], [5, 7], 2), [0, 5, 7, 7, 0]);
  assert.deepEqual(sampleAndHold([0, 1], [], [], 2), [0, 0]);
  assert.deepEqual(sampleAndHold([0, 1], [0, 1], [null, 3], 2), [0, 3]);
});

test('slotPeaks: a burst shorter than a slot fills its whole slot at its height', () => {
  // 1 s samples, 4 s slots: the burst at t=5 (one sample) holds 4 to 7
  const x = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9];
  const util = [0, 0, 0, 0, 0, 90, 0, 0, 0, null];
  assert.deepEqual(slotPeaks(x, util, 4), [0, 0, 0, 0, 90, 90, 90, 90, 0, 0]);
  // slots from the epoch: the same sample keeps its slot however the window slides
  assert.deepEqual(slotPeaks(x.slice(3), util.slice(3), 4), [0, 90, 90, 90, 90, 0, 0]);
  // a slot of nothing known stays unknown; no slot keeps the values
  assert.deepEqual(slotPeaks([0, 1], [null, null], 4), [null, null]);
  assert.deepEqual(slotPeaks([0, 1], [3, null], 0), [3, null]);
});

test('peak: the highest known value', () => {
  assert.equal(peak([0, null, 93, 5]), 93);
  assert.equal(peak([null, undefined]), null);
  assert.equal(peak([]), null);
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

test('allowedActions is the server table; pinning never blocks a release by hand', () => {
  // The server's 409 rules (jupyter_gpushare/core/lifecycle.py ACTIONS), written out here so that a
  // wrong generated table fails: a restore may be asked mid-release (it follows the release) or
  // mid-restore (it joins it), and any kernel may be pinned, an untracked one included.
  const expected: { [state in KernelState]: IAllowed } = {
    active: { release: true, restore: false, pin: true },
    idle: { release: true, restore: false, pin: true },
    releasing: { release: false, restore: true, pin: true },
    released: { release: false, restore: true, pin: true },
    restoring: { release: false, restore: true, pin: true },
    failed: { release: false, restore: true, pin: true },
    untracked: { release: false, restore: false, pin: true }
  };
  for (const state of KernelStateValues) {
    assert.deepEqual(allowedActions(state), expected[state], state);
  }
  assert.deepEqual(Object.keys(ALLOWED_IN), ['release', 'restore', 'pin']);
  for (const states of Object.values(ALLOWED_IN)) {
    assert.ok(
      states.every(s => KernelStateValues.includes(s)),
      String(states)
    );
    assert.equal(new Set(states).size, states.length, String(states));
  }
});

test('kernelLabels tells every kernel row apart', () => {
  const labels = kernelLabels([
    { id: 'aaaaaaaa-1', name: 'python3', path: 'proj/a/train.ipynb' },
    { id: 'bbbbbbbb-2', name: 'python3', path: 'proj/b/train.ipynb' },
    { id: 'cccccccc-3', name: 'python3', path: 'solo.ipynb' },
    { id: 'dddddddd-4', name: 'python3', path: 'dup.ipynb' },
    { id: 'eeeeeeee-5', name: 'python3', path: 'dup.ipynb' },
    { id: 'ffffffff-6', name: 'python3', path: '' },
    { id: 'gggggggg-7', name: '', path: '' }
  ]);
  assert.deepEqual(Object.fromEntries(labels), {
    'aaaaaaaa-1': 'a/train.ipynb',
    'bbbbbbbb-2': 'b/train.ipynb',
    'cccccccc-3': 'solo.ipynb',
    'dddddddd-4': 'dup.ipynb (dddddddd)',
    'eeeeeeee-5': 'dup.ipynb (eeeeeeee)',
    'ffffffff-6': 'python3 ffffffff',
    'gggggggg-7': 'kernel gggggggg'
  });
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
        gpu: { '0': [1, 1, 1] },
        gpu_utilization: { '0': [0, 0, 0] }
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
        gpu: { '0': [1, 1, 1], '1': [0, 1, 1] },
        gpu_utilization: { '1': [0, 9, 9] }
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
  // Per-GPU utilization merges the same way: a new index is padded, a missing one continued.
  assert.deepEqual(merged.kernels.k.gpu_utilization, {
    '0': [0, 0, null, null],
    '1': [null, null, 9, 9]
  });
  // A kernel whose samples all left the window is dropped.
  assert.equal('gone' in merged.kernels, false);
});
