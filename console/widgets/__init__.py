"""The console's panels: one module per panel, each patched from `ConsoleState` by the screen."""
