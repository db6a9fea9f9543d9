/** The panel's GPU icon (a chip with pins), themed through JupyterLab's icon classes. */
import { LabIcon } from '@jupyterlab/ui-components';

const svg = `<svg xmlns="http://www.w3.org/2000/svg" width="16" height="16" viewBox="0 0 24 24">
  <g class="jp-icon3" fill="#616161">
    <path d="M7 7h10v10H7z" fill-opacity="0.25"/>
    <path d="M6 5h12a1 1 0 0 1 1 1v12a1 1 0 0 1-1 1H6a1 1 0 0 1-1-1V6a1 1 0 0 1 1-1zm1 2v10h10V7H7z"/>
    <path d="M9 9h6v6H9z"/>
    <path d="M8 1h2v3H8zm3 0h2v3h-2zm3 0h2v3h-2zM8 20h2v3H8zm3 0h2v3h-2zm3 0h2v3h-2zM1 8h3v2H1zm0 3h3v2H1zm0 3h3v2H1zm19-6h3v2h-3zm0 3h3v2h-3zm0 3h3v2h-3z"/>
  </g>
</svg>`;

export const gpuIcon = new LabIcon({ name: 'jupyter-gpushare:gpu', svgstr: svg });
