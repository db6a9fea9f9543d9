/**
 * Kernel rows as a new user reads them (issue 18): the order of the rows, where a long name is
 * cut, and the state shown while a release or restore from this page is on its way.
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import { relativeTicks, relativeTimeLabel, splitForEllipsis, timingClauses } from '../src/format';
import { displayedState, sortKernels } from '../src/rules';
import { KernelStateValues } from '../src/contract';

test('sortKernels sorts names as a person does: case-insensitive and numeric', () => {
  const kernels = [
    { id: '1', path: 'Zeta.ipynb' },
    { id: '2', path: 'alpha.ipynb' },
    { id: '3', path: 'Beta.ipynb' },
    { id: '4', path: 'run10.ipynb' },
    { id: '5', path: 'run2.ipynb' },
    { id: '6', path: '' },
    { id: '7', path: 'beta.ipynb' },
    { id: '8', path: 'alpha.ipynb' },
    { id: '9', path: 'Proj/x.ipynb' },
    { id: '10', path: 'data/y.ipynb' }
  ];
  const paths = (ids: string[]) => ids.map(id => `${kernels.find(k => k.id === id)!.path}#${id}`);
  assert.deepEqual(paths(sortKernels(kernels)), [
    'alpha.ipynb#2',
    'alpha.ipynb#8',
    'Beta.ipynb#3', // "B" and "b" sort together; the exact order only breaks the tie
    'beta.ipynb#7',
    'data/y.ipynb#10',
    'Proj/x.ipynb#9',
    'run2.ipynb#5',
    'run10.ipynb#4',
    'Zeta.ipynb#1',
    '#6' // no notebook: last
  ]);
  // The same order whatever order the server lists them in.
  assert.deepEqual(sortKernels([...kernels].reverse()), sortKernels(kernels));
});

test('splitForEllipsis keeps the extension (and a kernel suffix) out of the cut', () => {
  assert.deepEqual(splitForEllipsis('gpushare-demo.ipynb'), {
    head: 'gpushare-',
    tail: 'demo.ipynb'
  });
  const cases: [string, string][] = [
    ['gpushare-demo.ipynb', 'demo.ipynb'],
    ['a/very-long-experiment-name.ipynb', 'name.ipynb'],
    ['dup.ipynb (dddddddd)', 'dup.ipynb (dddddddd)'],
    ['training-run.ipynb (1a2b3c4d)', '-run.ipynb (1a2b3c4d)'],
    ['python3 ffffffff', 'ffffffff'],
    ['x.ipynb', 'x.ipynb'],
    ['', '']
  ];
  for (const [name, tail] of cases) {
    const split = splitForEllipsis(name);
    assert.equal(split.head + split.tail, name, name);
    assert.equal(split.tail || split.head, tail, name);
  }
  // An emoji is never cut in two.
  assert.deepEqual(splitForEllipsis('abcdefghij\u{1F600}bcdefgh'), {
    head: 'abcdefghij',
    tail: '\u{1F600}bcdefgh'
  });
});

test('displayedState shows releasing/restoring from the click on, else the server state', () => {
  assert.equal(displayedState('active', 'release'), 'releasing');
  assert.equal(displayedState('idle', 'release'), 'releasing');
  assert.equal(displayedState('released', 'restore'), 'restoring');
  assert.equal(displayedState('failed', 'restore'), 'restoring');
  // A restore asked mid-release follows it; one asked mid-restore joins it.
  assert.equal(displayedState('releasing', 'restore'), 'restoring');
  assert.equal(displayedState('restoring', 'restore'), 'restoring');
  assert.equal(displayedState('untracked', 'restore'), 'untracked');
  assert.equal(displayedState('releasing', 'release'), 'releasing');
  // The server's word wins once it says more than "before the click".
  assert.equal(displayedState('released', 'release'), 'released');
  assert.equal(displayedState('active', 'restore'), 'active');
  for (const state of KernelStateValues) {
    assert.equal(displayedState(state, null), state);
    assert.equal(displayedState(state, 'pin'), state);
  }
});

test('relativeTicks: round ages back from now, as many as fit', () => {
  const now = 1_000_000;
  // 10 minutes, room for 6 labels: every 2 minutes
  assert.deepEqual(
    relativeTicks(now - 600, now, 6),
    [-600, -480, -360, -240, -120, 0].map(d => now + d)
  );
  // room for 3: every 5 minutes
  assert.deepEqual(relativeTicks(now - 600, now, 3), [now - 600, now - 300, now]);
  // a young server's 40 s: every 10 s
  assert.deepEqual(
    relativeTicks(now - 40, now, 5),
    [-40, -30, -20, -10, 0].map(d => now + d)
  );
  // always "now" and one before it, never more than asked
  for (const span of [7, 61, 420, 3599, 7200, 86400]) {
    for (const most of [2, 3, 5, 8]) {
      const ticks = relativeTicks(now - span, now, most);
      assert.equal(ticks[ticks.length - 1], now);
      assert.ok(ticks.length >= 1 && ticks.length <= most, `${span} s, ${most}: ${ticks.length}`);
      assert.ok(ticks[0] >= now - span, `${span} s: ${ticks[0]}`);
    }
  }
});

test('relativeTimeLabel: "now" and ages, short enough for the panel', () => {
  const now = 1_000_000;
  assert.equal(relativeTimeLabel(now, now), 'now');
  assert.equal(relativeTimeLabel(now + 0.2, now), 'now');
  assert.equal(relativeTimeLabel(now - 5, now), '-5 s');
  assert.equal(relativeTimeLabel(now - 30, now), '-30 s');
  assert.equal(relativeTimeLabel(now - 300, now), '-5 min');
  assert.equal(relativeTimeLabel(now - 5400, now), '-1 h 30 min');
  for (const step of [5, 10, 30, 60, 120, 300, 600, 1800, 3600]) {
    assert.ok(relativeTimeLabel(now - 4 * step, now).length <= 8);
  }
});

test("timingClauses: the kernel's own idle timeout, and a restore's duration as one", () => {
  const k = {
    idle_seconds: 12,
    pinned: false,
    release_in_seconds: 18,
    release_policy: 'needs' as const,
    idle_timeout: 30,
    method: 'simulated',
    last_restore_seconds: 4.9
  };
  // `%gpushare idle-timeout 30` on a server whose default is 2 min: the row says 30 s
  assert.deepEqual(timingClauses(k, 'idle', 120), [
    'idle 12 s',
    'release after 30 s idle (in 18 s)',
    'method simulated',
    'last restore took 4.9 s'
  ]);
  // the server's default under "needs": released when its GPU needs room, or after long_idle
  assert.equal(
    timingClauses({ ...k, idle_timeout: 120, release_in_seconds: 7188 }, 'idle', 120)[1],
    'release if GPU needs room, or in 2 h if it is short'
  );
  // proactive: the server's timeout is the release
  assert.equal(
    timingClauses({ ...k, idle_timeout: 120, release_policy: 'proactive' }, 'idle', 120)[1],
    'release after 2 min idle (in 18 s)'
  );
  assert.equal(
    timingClauses({ ...k, pinned: true }, 'active', 120)[1],
    'never released automatically'
  );
  assert.equal(
    timingClauses({ ...k, idle_timeout: 0, release_in_seconds: null }, 'idle', 120)[1],
    'no automatic release'
  );
  // released: no release clause; no restore yet: no restore clause
  assert.deepEqual(timingClauses({ ...k, last_restore_seconds: null }, 'released', 120), [
    'idle 12 s',
    'method simulated'
  ]);
});
