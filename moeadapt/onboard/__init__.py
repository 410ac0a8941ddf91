"""moeadapt.onboard"""
