"""Static shapes: binding symbolic dimensions to the sizes QNN needs."""
