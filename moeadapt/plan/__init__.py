"""moeadapt.plan"""
