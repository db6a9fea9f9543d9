/**
 * Every id the extension exposes (plugin, commands, widgets, CSS classes) in one place,
 * so the UI tests and themes can rely on them.
 */

export const PLUGIN_ID = 'jupyter-gpushare:plugin';

export namespace CommandIDs {
  export const openPanel = 'gpushare:open-panel';
  export const refresh = 'gpushare:refresh';
  export const release = 'gpushare:release';
  export const restore = 'gpushare:restore';
  export const togglePin = 'gpushare:toggle-pin';
}

export namespace WidgetIDs {
  export const panel = 'jp-gpushare-panel';
  export const statusItem = 'jupyter-gpushare:status';
}

/** CSS classes; `data-*` attributes carry per-row identity (kernel id, GPU index, action). */
export namespace CSS {
  export const panel = 'jp-GPUShare-panel';
  export const header = 'jp-GPUShare-header';
  export const summary = 'jp-GPUShare-summary';
  export const message = 'jp-GPUShare-message';
  export const efficiency = 'jp-GPUShare-efficiency';
  export const gpuList = 'jp-GPUShare-gpus';
  export const gpu = 'jp-GPUShare-gpu';
  export const gpuTitle = 'jp-GPUShare-gpuTitle';
  export const gpuStats = 'jp-GPUShare-gpuStats';
  export const chart = 'jp-GPUShare-chart';
  export const kernelList = 'jp-GPUShare-kernels';
  export const kernel = 'jp-GPUShare-kernel';
  export const kernelName = 'jp-GPUShare-kernelName';
  export const kernelStats = 'jp-GPUShare-kernelStats';
  export const kernelError = 'jp-GPUShare-kernelError';
  export const badge = 'jp-GPUShare-badge';
  export const sparkline = 'jp-GPUShare-sparkline';
  export const actions = 'jp-GPUShare-actions';
  export const button = 'jp-GPUShare-button';
  export const statusItem = 'jp-GPUShare-statusItem';
  export const spinner = 'jp-GPUShare-spinner';
  export const empty = 'jp-GPUShare-empty';
  /** On <body> while the panel is open in the right sidebar: toasts move to its left. */
  export const toastsAside = 'jp-GPUShare-toastsAside';
}

/** Data attribute names used on kernel rows and buttons. */
export namespace Attr {
  export const kernelId = 'data-kernel-id';
  export const gpuIndex = 'data-gpu-index';
  export const state = 'data-state';
  export const action = 'data-action';
}
