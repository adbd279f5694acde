"""The built-in dashboard: static HTML, JS and CSS served at GET /dashboard, drawn only from the
public API with the visitor's own key (see static/app.js)."""
