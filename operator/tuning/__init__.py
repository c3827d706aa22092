"""SLO-driven live tuning: observe pods' metrics, decide knob changes (pure), apply them over HTTP."""
