/**
 * jupyter-gpushare JupyterLab extension: a side panel (GPUs, efficiency, kernels), a status
 * bar item for the current notebook's kernel, and notifications from the server's events.
 */
import {
  ILabShell,
  ILayoutRestorer,
  JupyterFrontEnd,
  JupyterFrontEndPlugin
} from '@jupyterlab/application';
import { ICommandPalette, IThemeManager } from '@jupyterlab/apputils';
import { INotebookTracker, NotebookPanel } from '@jupyterlab/notebook';
import { ISettingRegistry } from '@jupyterlab/settingregistry';
import { IStatusBar } from '@jupyterlab/statusbar';

import { AheadRestorer, backAtNotebook, NOTEBOOK_INPUT_EVENTS } from './ahead';
import { GPUShareAPI } from './api';
import { gpuIcon } from './icon';
import { CommandIDs, PLUGIN_ID, WidgetIDs } from './ids';
import { GPUShareModel } from './model';
import { connectNotifications, EVENT_SCHEMA_ID } from './notifications';
import { GPUSharePanel } from './panel';
import { GPUStatusItem } from './statusbar';

/** A notebook cell's shared (collaborative) model: its `changed` says what changed. */
type SharedCell = NonNullable<NotebookPanel['content']['activeCell']>['model']['sharedModel'];

interface ISettings {
  refreshInterval: number;
  historySeconds: number;
  notifications: boolean;
}

const DEFAULTS: ISettings = { refreshInterval: 2000, historySeconds: 600, notifications: true };

const plugin: JupyterFrontEndPlugin<void> = {
  id: PLUGIN_ID,
  description: 'GPU memory held versus used per kernel; release and restore idle kernels.',
  autoStart: true,
  optional: [
    ISettingRegistry,
    ILayoutRestorer,
    IStatusBar,
    INotebookTracker,
    IThemeManager,
    ICommandPalette,
    ILabShell
  ],
  activate: (
    app: JupyterFrontEnd,
    settingRegistry: ISettingRegistry | null,
    restorer: ILayoutRestorer | null,
    statusBar: IStatusBar | null,
    notebooks: INotebookTracker | null,
    themes: IThemeManager | null,
    palette: ICommandPalette | null
  ) => {
    const settings: ISettings = { ...DEFAULTS };
    const api = new GPUShareAPI(app.serviceManager.serverSettings);
    const model = new GPUShareModel({
      api,
      refreshInterval: settings.refreshInterval,
      historySeconds: settings.historySeconds
    });

    const panel = new GPUSharePanel({
      model,
      icon: gpuIcon,
      open: path => void app.commands.execute('docmanager:open', { path })
    });
    app.shell.add(panel, 'right', { rank: 900 });
    restorer?.add(panel, WidgetIDs.panel);
    themes?.themeChanged.connect(() => panel.themeChanged());

    const openPanel = () => app.shell.activateById(panel.id);
    /** The kernel a command acts on: its `kernelId` argument, else the current notebook's. */
    const targetKernel = (args: { kernelId?: unknown }): string | null =>
      (typeof args.kernelId === 'string' && args.kernelId) ||
      notebooks?.currentWidget?.sessionContext.session?.kernel?.id ||
      null;

    app.commands.addCommand(CommandIDs.openPanel, {
      label: 'GPU Sharing Panel',
      caption: 'Show GPU memory held and used per kernel',
      icon: gpuIcon,
      execute: openPanel
    });
    app.commands.addCommand(CommandIDs.refresh, {
      label: 'Refresh GPU Sharing Status',
      execute: () => model.refresh()
    });
    app.commands.addCommand(CommandIDs.release, {
      label: 'Release GPU Memory of This Kernel',
      isEnabled: () => targetKernel({}) !== null,
      execute: args => {
        const id = targetKernel(args);
        return id ? model.release(id) : undefined;
      }
    });
    app.commands.addCommand(CommandIDs.restore, {
      label: 'Restore GPU Memory of This Kernel',
      isEnabled: () => targetKernel({}) !== null,
      execute: args => {
        const id = targetKernel(args);
        return id ? model.restore(id) : undefined;
      }
    });
    app.commands.addCommand(CommandIDs.togglePin, {
      label: 'Pin Kernel on the GPU (Never Release Automatically)',
      isToggled: () => {
        const id = targetKernel({});
        return id ? !!model.kernel(id)?.pinned : false;
      },
      isEnabled: () => targetKernel({}) !== null,
      execute: args => {
        const id = targetKernel(args);
        return id ? model.setPinned(id, !model.kernel(id)?.pinned) : undefined;
      }
    });
    if (palette) {
      const category = 'GPU Sharing';
      [
        CommandIDs.openPanel,
        CommandIDs.refresh,
        CommandIDs.release,
        CommandIDs.restore,
        CommandIDs.togglePin
      ].forEach(command => palette.addItem({ command, category }));
    }

    if (statusBar) {
      const item = new GPUStatusItem(model, openPanel);
      statusBar.registerStatusItem(WidgetIDs.statusItem, {
        item,
        align: 'left',
        rank: 4,
        isActive: () => item.isActiveItem,
        activeStateChanged: item.activeChanged
      });
      if (notebooks) {
        const follow = () => item.setSession(notebooks.currentWidget?.sessionContext ?? null);
        notebooks.currentChanged.connect(follow);
        follow();
      }
    }

    if (notebooks) {
      // Restore ahead: a person works in a notebook whose kernel is released (it becomes the
      // current notebook, a code cell of it is edited, a key or pointer is pressed in it, or
      // they come back to the page with it in front). Only the current notebook asks, so a
      // page load with many open tabs asks for one kernel at most.
      const ahead = new AheadRestorer({
        kernel: id => model.kernel(id),
        send: id => api.restoreAhead(id).then(() => model.refresh())
      });
      const kernelOf = (nb: NotebookPanel | null) => nb?.sessionContext.session?.kernel?.id ?? null;
      // Only a person's typing counts: a running cell's outputs and execution count change the
      // notebook too (the output of `%gpushare release` would restore the kernel it released).
      const follow = (nb: NotebookPanel) => {
        let watched: SharedCell | null = null;
        const onChange = (_: unknown, change: { sourceChange?: unknown }) => {
          if (change.sourceChange && notebooks.currentWidget === nb) {
            ahead.activity(kernelOf(nb));
          }
        };
        const watchActiveCell = () => {
          const cell = nb.content.activeCell;
          const shared = cell?.model.type === 'code' ? cell.model.sharedModel : null;
          if (shared !== watched) {
            watched?.changed.disconnect(onChange);
            watched = shared;
            watched?.changed.connect(onChange);
          }
        };
        nb.content.activeCellChanged.connect(watchActiveCell);
        watchActiveCell();
        // Presses, not edits: someone back from a break often runs a cell as it is.
        const pressed = () => {
          if (notebooks.currentWidget === nb) {
            ahead.activity(kernelOf(nb));
          }
        };
        for (const type of NOTEBOOK_INPUT_EVENTS) {
          nb.node.addEventListener(type, pressed, { capture: true, passive: true });
        }
      };
      notebooks.forEach(follow);
      notebooks.widgetAdded.connect((_, nb) => follow(nb));
      notebooks.currentChanged.connect((_, nb) => ahead.activity(kernelOf(nb)));
      // Back at the page (its tab shown again, its window focused) with a notebook in front.
      const cameBack = (event: Event) => {
        const nb = notebooks.currentWidget;
        const inFront = nb !== null && app.shell.currentWidget === nb;
        if (backAtNotebook(event.type, document.visibilityState, inFront)) {
          ahead.activity(kernelOf(nb));
        }
      };
      document.addEventListener('visibilitychange', cameBack);
      window.addEventListener('focus', cameBack);
    }

    // The panel and status bar follow the server's events at once, not at the next poll.
    model.followEvents(app.serviceManager.events.stream, EVENT_SCHEMA_ID);
    connectNotifications({
      stream: app.serviceManager.events.stream,
      model,
      enabled: () => settings.notifications,
      openPanel
    });

    if (settingRegistry) {
      const apply = (loaded: ISettingRegistry.ISettings) => {
        settings.refreshInterval = loaded.get('refreshInterval').composite as number;
        settings.historySeconds = loaded.get('historySeconds').composite as number;
        settings.notifications = loaded.get('notifications').composite as boolean;
        model.configure(settings.refreshInterval, settings.historySeconds);
        panel.update();
      };
      settingRegistry
        .load(PLUGIN_ID)
        .then(loaded => {
          apply(loaded);
          loaded.changed.connect(apply);
        })
        .catch(reason => console.error('jupyter-gpushare: could not load settings', reason));
    }
  }
};

export default plugin;
