/**
 * Kernel rows as a new user reads them (issue 18): the order of the rows, where a long name is
 * cut, and the state shown while a release or restore from this page is on its way.
 */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import { splitForEllipsis, timeTickLabel } from '../src/format';
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

test('timeTickLabel: one short line, minutes on minute ticks, seconds between', () => {
  const at = (h: number, m: number, s: number) => new Date(2025, 0, 1, h, m, s).getTime() / 1000;
  assert.equal(timeTickLabel(at(15, 45, 0), 60), '3:45pm');
  assert.equal(timeTickLabel(at(15, 45, 0), 300), '3:45pm');
  assert.equal(timeTickLabel(at(0, 5, 0), 60), '12:05am');
  assert.equal(timeTickLabel(at(12, 0, 0), 3600), '12:00pm');
  assert.equal(timeTickLabel(at(15, 45, 30), 15), ':30');
  assert.equal(timeTickLabel(at(15, 45, 5), 5), ':05');
  // A minute within second ticks says which minute (uPlot's default wrote ":00").
  assert.equal(timeTickLabel(at(15, 46, 0), 15), '3:46pm');
  for (let t = at(0, 0, 0); t < at(24, 0, 0); t += 97) {
    const label = timeTickLabel(t, 60);
    assert.ok(!label.includes('\n') && label.length <= 7, label);
  }
});
