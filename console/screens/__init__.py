"""The console's screens: the main mesh screen and its modals (confirm, target picker, help)."""
